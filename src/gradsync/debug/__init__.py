"""Finding the cause of a failed run: the flight recorder and the reader of its dumps.

The flight recorder (:mod:`~gradsync.debug.flight`) every rank keeps of its last collectives, and
its reader (:mod:`~gradsync.debug.analyze`, ``gradsync debug DIR``).
"""
