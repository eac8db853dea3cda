"""The training application: data, models, the loop, metrics and plots."""
