# make demo: create .venv, install, run the digits job on 2 local Ray nodes, plot its loss.
# make test: create .venv, install, run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STORAGE ?= /tmp/raylaunch-runs
# More options for the demo's run, e.g. DEMO_ARGS="--set config.epochs=1" (the tests' short demo).
DEMO_ARGS ?=
ifndef DEMO_RUN
DEMO_RUN := digits-$(shell date +%Y%m%d-%H%M%S)
endif

.PHONY: install demo demo-stream test clean bench bench-scale bench-elastic bench-checkpoint bench-exits bench-recovery gpu-check chaos soak

$(BIN)/raylaunch: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

install: $(BIN)/raylaunch

demo: install
	$(BIN)/raylaunch run jobs/examples/digits.yaml --local-nodes 2 --storage $(STORAGE) --name $(DEMO_RUN) $(DEMO_ARGS)
	$(BIN)/raylaunch plot $(DEMO_RUN) --metric loss --storage $(STORAGE) -o $(STORAGE)/$(DEMO_RUN)/loss.png
	$(BIN)/raylaunch runs --storage $(STORAGE)

# The second example: the same model trained from a stream of parquet shards, each rank reading its own.
demo-stream: install
	$(BIN)/raylaunch run jobs/examples/digits-stream.yaml --local-nodes 2 --storage $(STORAGE) --name digits-stream-$(shell date +%Y%m%d-%H%M%S)

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) raylaunch-local

# Benchmark against torchrun and Ray Train (quick: about two minutes, then the checkpoint bench, about four more; BENCH_FULL=1: 3 repetitions of 240 steps, about seventeen minutes;
# BENCH_GPU=1: on this machine's GPUs with NCCL).
bench: install
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,bench]'
	$(BIN)/python bench/run.py
	$(BIN)/python -m bench.checkpoints

# How long a save holds training with 600 MB of state a rank: session.save (checkpoint.async true and false)
# against Accelerate's save_state to local disk, alternating, on 2 simulated nodes (about 4 minutes;
# BENCH_CKPT_REPS=<n>, default 3; BENCH_CKPT_STORAGE=s3://... for an object store). Writes bench/results-checkpoints.md.
bench-checkpoint: install
	$(BIN)/python -m bench.checkpoints

# The driver at 16, 128, 1,024 and 4,096 ranks against simulated nodes (about 7 minutes; SCALE_BENCH_S=<seconds of
# training per size>, default 40, for longer; SCALE_BENCH_SIZES=16,128 for fewer): its cores, peak memory and the
# lag to metrics.jsonl.
bench-scale: install
	$(BIN)/python -m bench.scale

# A script that finished, reported failed: the same plain Accelerate script run again and again under accelerate
# launch, torchrun and raylaunch launch (a warm cluster), in turn (about 13 minutes; EXITS_RUNS=<n>, default 30).
# Writes bench/results-exits.md.
bench-exits: install
	$(BIN)/python -m bench.exits

# Node lost -> training again on fewer nodes: raylaunch's elastic run (min_nodes: 1, resize_s: 1) against Ray Train
# V2's num_workers=(1, 2), interleaved on one local cluster of 2 one-CPU nodes (about 6 minutes; BENCH_REPS=<n>,
# default 2; BENCH_GROW=0 skips growing back; BENCH_RT_START_TIMEOUT_S=<s> sets Ray Train's worker group start
# timeout, 60 s by default). Writes bench/results-elastic.md.
bench-elastic: install
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,bench]'
	$(BIN)/python -m bench.elastic

# Lost work under a schedule of failures (a rank SIGKILLed every T, a node removed every 2T, then a node drained with
# a 30-second deadline; issue #59): raylaunch with snapshots in memory (skipped, and said, where the spec lacks
# checkpoint.snapshots), raylaunch with storage commits only and Ray Train checkpointing to the same storage,
# interleaved on 2 simulated nodes: steps lost and seconds back to training per failure, goodput, host memory, step
# time with snapshots on against off; then the bar's case (a few hundred KB of state). 576 MiB of state a rank; about
# 12 minutes on a loaded 2-core machine (RECOVERY_STATE_MB=<MiB>; RECOVERY_T=<s>, default 30; RECOVERY_FAILURES=<n>,
# default 3; RECOVERY_REPS; RECOVERY_NODES=4; RECOVERY_DRAIN=0 skips the drain; RECOVERY_COMMIT=auto: raylaunch's
# checkpoint.every: auto; RECOVERY_IDLE_S=1: each step also waits 1 s with its CPU idle, as a GPU step's host does,
# and writes bench/results-recovery-idle.md). Writes bench/results-recovery.md.
bench-recovery: install
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,bench]'
	$(BIN)/python -m bench.recovery

# Training jobs under a seeded schedule of faults (ranks killed and stopped, node actors killed, nodes lost, the
# driver killed and run again, the disk full during a save), some inside a recovery or a commit, on a local cluster of
# 2 nodes; checks the final model, the data order, the storage and that no process is left. About 10 minutes;
# CHAOS_S=<seconds> for longer, CHAOS_SEED=<n> to replay a schedule (random otherwise; the results name it).
# Writes bench/results-chaos.md; exits 1 when a fault was not survived. See docs/faults.md#chaos.
CHAOS_S ?= 600
chaos: install
	CHAOS_S=$(CHAOS_S) CHAOS_SEED=$(CHAOS_SEED) $(BIN)/python bench/chaos.py

# SOAK_JOBS jobs (45: about 15 minutes here) back to back on one warm 2-node `ray start` cluster; what each leaves.
# Writes bench/results-soak.md; exits 1 when a job's outcome is wrong or raylaunch's disk, processes, open files or
# warm hosts' memory grow. See docs/faults.md#long-lived-clusters.
SOAK_JOBS ?= 45
soak: install
	SOAK_JOBS=$(SOAK_JOBS) $(BIN)/python bench/soak.py

# On a machine with 1 to 8 GPUs, in under ten minutes, with or without a package index: a probe with 3 GiB of GPU state
# (every save's hold against save_state, a bitwise resume), the bench's GPU mode (raylaunch against torchrun and Ray
# Train with NCCL), FSDP against DDP in fp32, bf16 and fp16; with 2+ GPUs the NCCL hang test and --local-nodes 2.
# Installs nothing when what it needs imports already; WHEELS=<dir> (bench/gpu/prepare_wheels.sh, built where pip
# works) installs from that folder with --no-index. Writes bench/gpu/results/ (check.log and the results files).
gpu-check:
	WHEELS=$(WHEELS) bench/gpu/check.sh bench/gpu/results
