"""Elastic training: survivors keep training when a worker dies, replacements join from a live peer.

Within an elastic run membership is gradsync's (docs/elastic.md): the quorum
service (:mod:`~gradsync.elastic.service`, a process of its own holding the
run's store and the :class:`~gradsync.elastic.quorum.Quorum`) decides each
membership from the events the launchers (:mod:`~gradsync.elastic.launcher`,
one per worker: they only relaunch) and the members
(:mod:`~gradsync.elastic.member`) post. Each membership gets a fresh
communicator among its members, built without restarting any process.
"""
