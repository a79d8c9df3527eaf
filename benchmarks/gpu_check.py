"""`make gpu-check`: a job end to end on a lent GPU machine, with the figures that matter there.

For each model (the tiny one, and a checkpoint shaped like Qwen2.5-0.5B at full depth:
`robustrl model init --like qwen2.5-0.5b`, bf16, tied embeddings, a 151,936-token vocabulary)
it starts the local stack (`robustrl up`: embedded etcd, coordinators, a monitor, 1 trainer,
2 rollouts), runs a GRPO job with the trainer on CUDA in bf16 as one FSDP2 rank and the
rollouts on CUDA (vLLM where the machine has it, else the torch engine), and prints: the
median step time and trained tokens/s, the weight publish and pull rates (GB/s, from the
trainer's and rollouts' logs), and the peak GPU memory of the trainer (its own count) and of
every role's process (nvidia-smi, sampled each second). Weights travel over UCX where ucxx
imports (carried by `make gpu-bundle`), else over the gRPC stream, and the output says which.

    python benchmarks/gpu_check.py              # on a CUDA host; under 10 minutes on an H200
    python benchmarks/gpu_check.py --cpu        # the same flow on the CPU, tiny model only
    python benchmarks/gpu_check.py --dry        # what `make gpu-check-dry` runs: the checks
                                                # below, then the --cpu flow, a short job

Before anything else it checks that every module the stack imports is importable (in the
versions the generated gRPC code and the rest need) and that an etcd binary is found, and
names what is missing instead of failing somewhere in a service's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from robustrl.generation.modelgen import init_model  # noqa: E402

LIKE = "qwen2.5-0.5b"
"""The real-shaped checkpoint the check runs at full depth (494M parameters)."""

EXAMPLE = REPO / "examples" / "arithmetic-grpo.yaml"


NEEDED = {
    "grpc": "1.85.1",
    "grpc_health": "",
    "grpc_reflection": "",
    "google.protobuf": "7.35",
    "aetcd": "",
    "pydantic": "2.7",
    "pydantic_settings": "",
    "structlog": "",
    "prometheus_client": "",
    "rich": "",
    "xxhash": "",
    "yaml": "",
    "torch": "",
    "transformers": "",
    "safetensors": "",
    "numpy": "",
}
"""The modules the stack's processes import, with the least version where one matters (the
generated gRPC code checks grpc's at import)."""


def preflight() -> list[str]:
    """What is missing for the stack to start here: modules, versions, the etcd binary."""
    import importlib
    import importlib.util

    missing = []
    for module, least in NEEDED.items():
        if importlib.util.find_spec(module.split(".")[0]) is None:
            missing.append(f"{module}: not importable")
            continue
        if least:
            found = str(getattr(importlib.import_module(module), "__version__", "0"))
            if _version(found) < _version(least):
                missing.append(f"{module}: {found}, needs >= {least}")
    if missing:
        return missing  # robustrl.cli.stack imports some of them
    from robustrl.cli.stack import StackError, find_etcd

    try:
        print(f"gpu-check: etcd {find_etcd()}")
    except StackError as exc:
        missing.append(f"etcd: {exc}")
    return missing


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (tiny model only)")
    parser.add_argument(
        "--dry", action="store_true", help="the import and etcd checks, then a short --cpu run"
    )
    parser.add_argument("--tiny-steps", type=int, default=40)
    parser.add_argument("--large-steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=16, help="prompt groups a step")
    parser.add_argument("--job-timeout", type=float, default=240.0, help="seconds per job")
    return parser.parse_args(argv)


class GpuSampler:
    """Each process's GPU memory as nvidia-smi reports it, sampled every second; the peak."""

    def __init__(self) -> None:
        self.peak: dict[int, float] = {}
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            for line in out.splitlines():
                pid, _, used = line.partition(",")
                if pid.strip().isdigit() and used.strip().split(" ")[0].isdigit():
                    mib = float(used.strip().split(" ")[0])
                    self.peak[int(pid)] = max(self.peak.get(int(pid), 0.0), mib)


class Stack:
    """`robustrl` against a home of its own."""

    def __init__(self, home: Path, runs: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ROBUSTRL_")}
        self.env["ROBUSTRL_HOME"] = str(home)
        self.env["ROBUSTRL_TRAINER_RUNS_DIR"] = str(runs)
        self.env.setdefault("PYTHONPATH", str(REPO))
        self.home = home

    def run(self, *args: str, timeout: float = 300) -> str:
        argv = [sys.executable, "-m", "robustrl.cli.main", *args]
        done = subprocess.run(
            argv, capture_output=True, text=True, env=self.env, cwd=REPO, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"robustrl {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout


def rates(log: Path, event: str) -> list[float]:
    """GB/s of each `event` line (bytes and seconds) in a service's log."""
    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if event not in line:
            continue
        size, took = re.search(r"\bbytes=(\d+)", line), re.search(r"\bseconds=([\d.e-]+)", line)
        if size and took and float(took.group(1)) > 0:
            out.append(int(size.group(1)) / float(took.group(1)) / 1e9)
    return out


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "n/a"


def run_job(
    name: str, model: Path, steps: int, device: str, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    stack = Stack(work / f"home-{name}", work / f"runs-{name}")
    try:
        import ucxx  # noqa: F401

        transport = "ucx"
    except Exception:
        transport = "grpc"
    import importlib.util

    engine = "vllm" if device == "cuda" and importlib.util.find_spec("vllm") else "torch"
    started = time.monotonic()
    stack.run("up", "--trainers", "1", "--rollouts", "2", timeout=600)
    up_s = time.monotonic() - started
    members: list[dict[str, Any]] = []
    try:
        with GpuSampler() as gpu:
            stack.run(
                "submit",
                str(EXAMPLE),
                "--id",
                name,
                f"model.path={model}",
                f"trainer.steps={steps}",
                f"trainer.groups_per_step={args.groups}",
                "trainer.eval_every=100000",
                f"trainer.device={device}",
                # fsdp ranks publish their shares over UCX only.
                f"trainer.strategy={'fsdp' if transport == 'ucx' else 'ddp'}",
                "trainer.world_size=1",
                f"trainer.weight_transport={transport}",
                f"rollout.engine={engine}",
            )
            time.sleep(5)
            members = json.loads(stack.run("members", "--json"))
            stack.run("watch", name, timeout=args.job_timeout)
        status = json.loads(stack.run("status", name, "--json"))
    finally:
        stack.run("down", timeout=120)
    rows = [
        json.loads(line)
        for line in (work / f"runs-{name}" / name / "metrics.jsonl").read_text().splitlines()
    ]
    stepped = [r for r in rows if "step_seconds" in r][2:]  # the first steps warm up
    logs = stack.home / "logs"
    by_role: dict[str, float] = {}
    for m in members:
        peak = gpu.peak.get(int(m["pid"]))
        if peak is not None and m["role"] in ("trainer", "rollout"):
            by_role[m["instance_id"]] = peak
    return {
        "phase": status["phase"],
        "transport": transport,
        "engine": engine,
        "up_s": up_s,
        "step_s": statistics.median(r["step_seconds"] for r in stepped) if stepped else None,
        "tokens_per_s": (
            statistics.median(r["tokens_per_s"] for r in stepped) if stepped else None
        ),
        "trainer_gpu_peak_mib": max((r.get("gpu_peak_mib", 0.0) for r in rows), default=0.0),
        "publish_gbps": rates(logs / "trainer-0.log", "weights.published"),
        "pull_gbps": rates(logs / "rollout-0.log", "weights.pulled")
        + rates(logs / "rollout-1.log", "weights.pulled"),
        "gpu_peak_by_member": by_role,
        "nvidia_smi": gpu.available,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    missing = preflight()
    if missing:
        print("gpu-check: cannot start the stack here; missing:\n  " + "\n  ".join(missing))
        print("(`make gpu-bundle` carries robustrl's own dependencies; torch and transformers")
        print(" are the machine's)")
        return 2
    if args.dry:
        args.cpu, args.tiny_steps = True, min(args.tiny_steps, 6)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        print("no CUDA device here; --cpu runs the same flow on the CPU with the tiny model")
        return 2
    device = "cuda" if cuda and not args.cpu else "cpu"
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"gpu-check: torch {torch.__version__} on {name}, trainer {device}")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    failed = False
    try:
        models = [("tiny", init_model(work / "tiny", seed=0), args.tiny_steps)]
        if device == "cuda":
            from robustrl.generation.real_shapes import write_like

            made = time.monotonic()
            models.append(("large", write_like(LIKE, work / "large", seed=0), args.large_steps))
            print(f"generated the {LIKE}-shaped model in {time.monotonic() - made:.0f} s")
        for label, path, steps in models:
            params = _parameters(path)
            result = run_job(label, path, steps, device, args, work)
            failed |= result["phase"] != "SUCCEEDED"
            print(
                f"\n{label} ({params / 1e6:.1f}M parameters, {steps} steps, {args.groups} groups a "
                f"step, weights over {result['transport']}, {result['engine']} engine): job "
                f"{result['phase']}, stack up in "
                f"{result['up_s']:.0f} s"
            )
            step = result["step_s"]
            print(f"  step time median {step:.3f} s" if step else "  step time: n/a")
            tps = result["tokens_per_s"]
            print(f"  trained tokens/s median {tps:.0f}" if tps else "  tokens/s: n/a")
            print(
                f"  weight publish GB/s median {median(result['publish_gbps'])} "
                f"({len(result['publish_gbps'])} versions); pull GB/s median "
                f"{median(result['pull_gbps'])} ({len(result['pull_gbps'])} pulls)"
            )
            if device == "cuda":
                print(f"  trainer peak GPU memory (torch) {result['trainer_gpu_peak_mib']:.0f} MiB")
            if result["gpu_peak_by_member"]:
                for member, mib in sorted(result["gpu_peak_by_member"].items()):
                    print(f"  peak GPU memory of {member} (nvidia-smi): {mib:.0f} MiB")
            elif device == "cuda":
                print("  per-process GPU memory: nvidia-smi listed none of the roles' processes")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\ngpu-check:", "FAILED" if failed else "ok")
    return 1 if failed else 0


def _parameters(path: Path) -> int:
    """Parameters of the model at `path`, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
