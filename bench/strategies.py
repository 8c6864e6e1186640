"""FSDP against DDP under raylaunch, changing only the spec: `python bench/strategies.py [--gpu]`.

For the bench's MLP (bench/fn.py, 2.1M parameters) and the transformers example's model
(digits BERT, FSDP wrapping its BertLayer), each run once under DDP and once under FSDP
(`--set accelerate.fsdp=...`), alternating, on one warm Ray cluster started here: the steady
step time, what each rank holds (parameters + optimizer state: its shards under FSDP) and each
rank's peak memory as the runner records it (resident on CPU, `peak_gpu_mb` on GPUs).
`--gpu` runs on this machine's GPUs (`workers_per_node: auto`, NCCL) in bf16 and fp16 too, and
appends its table to bench/results-gpu.md (`make gpu-check`); on CPU it writes
bench/results-strategies.md.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import BIN, ROOT, start_head  # noqa: E402
from cluster.nodes.connect import stop_processes_under  # noqa: E402

GPU = "--gpu" in sys.argv
REPS = 1 if GPU else 2
MODELS = {"mlp": ({}, "{}"), "digits_bert": ({"model": "digits_bert"}, "{transformer_layer_cls_to_wrap: [BertLayer]}")}
PRECISIONS = ["no", "bf16", "fp16"] if GPU else ["no"]


def one_run(port: int, storage: Path, env: dict, model: str, strategy: str, precision: str) -> dict:
    config, fsdp = MODELS[model]
    name = f"{model}-{strategy}-{precision}-{secrets.token_hex(2)}"
    cmd = [str(BIN / "raylaunch"), "run", "bench/bench.yaml", "--address", f"127.0.0.1:{port}", "--quiet",
           "--storage", str(storage), "--name", name, "--set", f"accelerate.mixed_precision='{precision}'",
           "--set", f"scaling.use_gpu={str(GPU).lower()}",
           "--set", f"scaling.workers_per_node={'auto' if GPU else 2}",
           "--set", f"config={json.dumps({'steps': 60, 'log_block': 10, 'checkpoint_at': [], **config})}"]
    if strategy == "fsdp":
        cmd += ["--set", f"accelerate.fsdp={fsdp}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    run_dir = storage / name
    result = json.loads((run_dir / "result.json").read_text())
    peaks: dict[int, float] = {}
    key = "peak_gpu_mb" if GPU else "peak_rss_mb"
    metrics = run_dir / "metrics.jsonl"  # peak memory rows follow a rank's logged steps (log_block)
    for line in (metrics.read_text().splitlines() if metrics.exists() else []):
        row = json.loads(line)
        if key in row:
            peaks[row["rank"]] = max(peaks.get(row["rank"], 0.0), row[key])
    ranks = result["rank_results"]
    return {"steady_ms": 1000 * ranks["0"]["steady_step_s"], "world_size": result["world_size"],
            "held_mb": [ranks[r]["held_mb"] for r in sorted(ranks, key=int)],
            "peak_mb": [peaks.get(int(r)) for r in sorted(ranks, key=int)],
            "sharded": "model sharded with FSDP" in done.stdout + done.stderr}


def main() -> int:
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="rls-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    if GPU:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 1:
            sys.exit("--gpu: this machine has no CUDA GPU that torch can use")
        resources = [f"--num-cpus={2 * gpus}", f"--num-gpus={gpus}"]
    else:
        resources = ["--num-cpus=2"]
    port = start_head(tmp, env, resources)
    rows: dict[tuple, list[dict]] = {}
    failed: dict[tuple, str] = {}
    try:
        for rep in range(REPS):
            for model in MODELS:
                for precision in PRECISIONS:
                    for strategy in ("ddp", "fsdp"):
                        try:
                            r = one_run(port, tmp / "runs", env, model, strategy, precision)
                        except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
                            # the other combinations go on; the table says which failed and how
                            failed[(model, precision, strategy)] = str(exc).strip().splitlines()[-1][:300]
                            print(f"rep {rep + 1}/{REPS} {model:11s} {precision:4s} {strategy:4s} FAILED: {exc}",
                                  flush=True)
                            continue
                        rows.setdefault((model, precision, strategy), []).append(r)
                        print(f"rep {rep + 1}/{REPS} {model:11s} {precision:4s} {strategy:4s} steady "
                              f"{r['steady_ms']:7.1f} ms, held per rank {r['held_mb']}, peak {r['peak_mb']}",
                              flush=True)
    finally:
        stop_processes_under(str(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
    world = next(iter(rows.values()))[0]["world_size"] if rows else "?"
    unit = "peak GPU memory allocated" if GPU else "peak resident memory"
    lines = [f"FSDP against DDP under raylaunch, world size {world} ({'GPUs, NCCL, workers_per_node: auto' if GPU else 'CPU, gloo'}), "
             f"{REPS} alternating run(s) each, 60 steps; steady step of rank 0 (median), per rank: parameters + "
             f"optimizer state held, and the {unit} the runner recorded.", "",
             "| model | precision | strategy | steady step | ratio to DDP | held per rank | " + unit + " per rank |",
             "|---|---|---|---|---|---|---|"]
    for (model, precision, strategy), error in failed.items():
        if (model, precision, strategy) not in rows:
            lines.append(f"| {model} | {precision} | {strategy} | FAILED | - | {error} | - |")
    for (model, precision, strategy), rs in rows.items():
        steady = statistics.median(r["steady_ms"] for r in rs)
        ddp_rows = rows.get((model, precision, "ddp"))
        ddp = statistics.median(r["steady_ms"] for r in ddp_rows) if ddp_rows else float("nan")
        held = ", ".join(f"{v:.1f}" for v in rs[0]["held_mb"])
        peak = ", ".join("-" if v is None else f"{v:.0f}" for v in rs[0]["peak_mb"])
        lines.append(f"| {model} | {precision} | {strategy}{'' if strategy == 'ddp' or rs[0]['sharded'] else ' (NOT sharded)'} "
                     f"| {steady:.1f} ms | {steady / ddp:.2f} | {held} MiB | {peak} MiB |")
    lines.append(f"\n(took {time.monotonic() - began:.0f} s)")
    text = "\n".join(lines) + "\n"
    if GPU:
        with open(ROOT / "bench" / "results-gpu.md", "a") as f:
            f.write("\n## FSDP against DDP, bf16 and fp16\n\n" + text)
    else:
        (ROOT / "bench" / "results-strategies.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
