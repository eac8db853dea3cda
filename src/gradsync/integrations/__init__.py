"""Where people already train: Lightning's Trainer, Ray Train, TensorBoard (optional extras).

Each submodule needs its extra (``pip install 'gradsync[lightning]'``, ``[ray]``, ``[tensorboard]``)
and says which in one line (:class:`~gradsync.errors.MissingExtraError`) when it is missing. SLURM's
variables are read by ``gradsync.init()`` itself (:mod:`gradsync.slurm`). See docs/integrations.md.
"""
