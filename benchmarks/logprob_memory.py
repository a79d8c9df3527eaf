"""Peak memory and time of the trainer's logprob forward and backward, with the output head
run by chunks of positions (`services/trainer/grpo.py`, `token_logprobs`) and over the whole
batch at once, side by side, on a real-shaped checkpoint (`robustrl model init --like`).

With `--groups`, whole GRPO steps instead (`GRPOTrainer.step`: forward, backward, AdamW) over
G groups x `--group-size` completions of `--tokens` tokens each (a quarter of them prompt):
micro-batched by `--micro-batch-tokens` with the head by chunks, against the whole batch at
once with the head whole, where that fits. It prints each step's peak over the loaded model,
its optimizer state and gradients, and its seconds, then the micro-batched peak at the most
groups over that at the fewest, and the micro-batched step time over the whole one at each
size both ran.

Each (batch, path) runs in a fresh process that loads the model in fp32 (the trainer's master
weights), takes the forward and backward, and reports its peak resident memory above the
loaded model's, and the median seconds of `--repeats` passes. On a CPU the peak is the
process's resident peak (VmHWM, reset by /proc/self/clear_refs once the model is loaded, so
loading's own peak does not hide the step's); on a GPU (`--device cuda`) torch's own peak.

    python benchmarks/logprob_memory.py --model .robustrl/models/like-qwen \
        --rows 8,32 --tokens 128
    python benchmarks/logprob_memory.py --model .robustrl/models/like-qwen \
        --groups 8,64 --group-size 8 --tokens 256 --micro-batch-tokens 16384 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def reset_peak() -> int:
    """Reset this process's resident peak (VmHWM) to its current size; that size in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def peak_kib() -> int:
    """This process's resident peak since `reset_peak`, in KiB."""
    return _status_kib("VmHWM")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(model_dir: str, rows: int, tokens: int, chunk: int, device: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.grpo import token_logprobs

    torch.set_num_threads(1)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device)
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 - nn.Module types it as a Module
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens), generator=generator).to(device)
    mask = torch.ones_like(ids)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        token_logprobs(model, ids, mask, 1.0, chunk=chunk).sum().backward()

    return measure(forward_backward, device, repeats)


def one_step(
    model_dir: str, groups: int, size: int, tokens: int, budget: int, device: str, repeats: int
) -> dict:
    """A GRPO step over `groups` x `size` samples; `budget` 0: the whole batch, head whole."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.grpo import LOGPROB_CHUNK_POSITIONS, GRPOConfig, GRPOTrainer, Sample

    torch.set_num_threads(1)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device)
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 - nn.Module types it as a Module
    chunk = LOGPROB_CHUNK_POSITIONS if budget else 0
    config = GRPOConfig(lr=1e-6, micro_batch_tokens=budget, logprob_chunk=chunk)
    trainer = GRPOTrainer(model, config, pad_id=0)
    generator = torch.Generator().manual_seed(0)
    prompt = max(1, tokens // 4)
    samples = [
        Sample(
            torch.randint(1, vocab, (prompt,), generator=generator).tolist(),
            torch.randint(1, vocab, (tokens - prompt,), generator=generator).tolist(),
            [-10.0] * (tokens - prompt),
            1.0 if i % 2 else -1.0,
        )
        for i in range(groups * size)
    ]
    # A step on one token first: AdamW's moments and the gradients, which every step holds
    # whatever its batch, are then part of the baseline, not of the peak.
    trainer.step([Sample(samples[0].prompt_ids[:1], samples[0].completion_ids[:1], [-10.0], 1.0)])
    return measure(lambda: trainer.step(samples), device, repeats)


def measure(work: Callable[[], object], device: str, repeats: int) -> dict:
    """The median seconds of `repeats` runs of `work`, and their peak memory in MiB over what
    was held before them."""
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = reset_peak()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = (peak_kib() - base_rss) / 1024
    return {"peak_mib": round(peak, 1), "seconds": round(statistics.median(seconds), 3)}


def run_one(args: argparse.Namespace, *one: str) -> dict | str:
    """One measurement in a fresh process (`--one ...` or `--one-step ...`): its result, or
    the last line of what it printed on failing."""
    argv = [sys.executable, __file__, "--model", args.model, "--device", args.device]
    argv += ["--repeats", str(args.repeats), *one]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if done.returncode:
        return (done.stderr.strip().splitlines() or ["?"])[-1][:200]
    result: dict = json.loads(done.stdout.splitlines()[-1])
    return result


def steps(args: argparse.Namespace) -> int:
    print(f"{'groups':>6} {'samples':>7} {'tokens':>6} {'path':>8} {'peak MiB':>9} {'s':>8}")
    table = {}
    sizes = [int(g) for g in args.groups.split(",")]
    for groups in sizes:
        for path, budget in (("micro", args.micro_batch_tokens), ("whole", 0)):
            one = ("--one-step", str(groups), str(args.group_size), str(args.tokens), str(budget))
            result = run_one(args, *one)
            samples = groups * args.group_size
            if isinstance(result, str):
                print(f"{groups:>6} {samples:>7} {args.tokens:>6} {path:>8} failed: {result}")
                continue
            table[(groups, path)] = result
            print(
                f"{groups:>6} {samples:>7} {args.tokens:>6} {path:>8} "
                f"{result['peak_mib']:>9.1f} {result['seconds']:>8.3f}",
                flush=True,
            )
    low, high = (min(sizes), "micro"), (max(sizes), "micro")
    if low in table and high in table and low != high:
        ratio = table[high]["peak_mib"] / max(table[low]["peak_mib"], 1e-9)
        print(f"micro-batched peak, {high[0]} groups over {low[0]}: {ratio:.2f}")
    for groups in sizes:
        if (groups, "micro") in table and (groups, "whole") in table:
            m, w = table[(groups, "micro")], table[(groups, "whole")]
            print(f"groups {groups}: micro/whole step time {m['seconds'] / w['seconds']:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint (`model init --like`)")
    parser.add_argument("--rows", default="8,32", help="sequences per batch, comma-separated")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--chunk", type=int, default=1024, help="positions per chunk")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", default="", help="whole GRPO steps over these group counts")
    parser.add_argument("--group-size", type=int, default=8, help="completions per group")
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=4096, help="trainer.micro_batch_tokens"
    )
    parser.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--one-step", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_step:
        groups, size, tokens, budget = args.one_step
        print(
            json.dumps(
                one_step(args.model, groups, size, tokens, budget, args.device, args.repeats)
            )
        )
        return 0
    if args.groups:
        return steps(args)
    if args.one:
        rows, tokens, chunk = args.one
        print(json.dumps(one(args.model, rows, tokens, chunk, args.device, args.repeats)))
        return 0
    print(f"{'rows':>5} {'tokens':>6} {'path':>8} {'peak MiB':>9} {'s':>7}")
    table = {}
    for rows in (int(r) for r in args.rows.split(",")):
        for path, chunk in (("chunked", args.chunk), ("whole", 0)):
            result = run_one(args, "--one", str(rows), str(args.tokens), str(chunk))
            if isinstance(result, str):
                print(f"{rows:>5} {args.tokens:>6} {path:>8} failed: {result}")
                continue
            table[(rows, path)] = result
            print(
                f"{rows:>5} {args.tokens:>6} {path:>8} {result['peak_mib']:>9.1f} "
                f"{result['seconds']:>7.3f}",
                flush=True,
            )
    for rows in sorted({r for r, _ in table}):
        if (rows, "chunked") in table and (rows, "whole") in table:
            c, w = table[(rows, "chunked")], table[(rows, "whole")]
            print(
                f"rows {rows}: chunked/whole peak {c['peak_mib'] / max(w['peak_mib'], 1e-9):.2f}"
                f", time {c['seconds'] / w['seconds']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
