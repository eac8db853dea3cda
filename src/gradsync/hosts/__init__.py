"""Test hosts: emulated machines in Linux namespaces (netns), their store, and one torchrun per host."""
