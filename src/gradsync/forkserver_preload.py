"""Imported first by the launcher's forkserver (``launch._WORKER_PRELOAD``): it dies with the launcher.

The workers are forked by the forkserver, so their ``PR_SET_PDEATHSIG``
(:func:`gradsync.launch.die_with_launcher`) watches the forkserver; the
forkserver in turn must die when the launcher does, even when the launcher
is killed with SIGKILL and cannot stop anyone. Importing this module
anywhere else would tie that process to its parent too: only the
forkserver's preload imports it.
"""

from gradsync.launch import die_with_launcher

die_with_launcher()
