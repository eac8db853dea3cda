"""How a job starts: validation, then {local, torchrun, test hosts} x {static, elastic} -> launcher, and the worker entry."""
