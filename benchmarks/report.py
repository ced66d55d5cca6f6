"""Writing results: ``<out>/<date>-<gpu>-<n>gpu.{json,md,png}`` and the console summary.

The JSON holds everything (environment, arguments, every record with its rank medians and
messages); the markdown the same as tables; the PNG the attention series (TFLOP/s per GPU by
variant) when matplotlib is installed. The console summary is short on purpose: one line per
record, then the meshfuse-vs-direct ratios (issue 2), then skips and errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable
from typing import Any

from benchmarks.context import machine_slug
from benchmarks.harness import Record

ATTENTION_CASES = ("attention_seed", "attention_large")
# the meshfuse variants of the headline, and what each is named there
MESHFUSE_VARIANTS = {"meshfuse": "execute", "meshfuse_interpreter": "execute(cuda_graph=False)",
                     "meshfuse_graph": "execute(cuda_graph=True)"}
# what "meshfuse" is compared with in the headline: the same calls made directly
DIRECT_COUNTERPARTS = ("direct", "torch_manual")


def file_stem(env: dict[str, Any], quick: bool, when: float | None = None) -> str:
    date = time.strftime("%Y-%m-%d-%H%M", time.localtime(when))
    n = env["world_size"]
    count = f"{n}gpu" if env.get("gpu_name") else f"{n}proc"
    return f"{date}-{machine_slug(env)}-{count}" + ("-quick" if quick else "")


def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 10:
        return f"{x:.2f}"
    return f"{x:.{digits}f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _extra(r: Record) -> str:
    """The short per-record detail: bandwidth, backend, host overhead, or the status."""
    if r.status != "ok":
        return f"{r.status.upper()}: {r.message}"
    m, parts = r.metrics, []
    if "busbw_gbps" in m:
        parts.append(f"busbw {m['busbw_gbps']:.1f} GB/s")
    if "backend" in m:
        parts.append(f"backend={m['backend']}")
    if "kernels" in m:
        parts.append(f"kernels={m['kernels']}")
    if "gpu_us" in m:
        gap = "" if r.host_us is None else f" (host-gpu {r.host_us - m['gpu_us']:+.1f})"
        parts.append(f"gpu {m['gpu_us']:.1f} us{gap}")
    if m.get("host_overhead_us") is not None:
        parts.append(f"{m['host_overhead_us']:+.1f} us/call ({m['host_ratio']:.2f}x host)")
    if "host_note" in m:
        parts.append(m["host_note"])
    if "pct_of_ideal" in m:  # context parallel: ideal = one GPU's time / ranks
        parts.append(f"{m['pct_of_ideal']:.1f}% of ideal")
    if "strategies" in m:
        parts.append("fwd/bwd " + "/".join(v["strategy"] for v in m["strategies"].values()))
    if "fastest" in m:
        picks = "/".join(m["estimate_picks_measured"].values())
        parts.append(f"{m['kernel_tflops']} TFLOP/s, {m['link_gbps']} GB/s: estimate picks "
                     f"{picks}, fastest {m['fastest']}")
    if "summary" in m:  # a case's own one-line finding (e.g. an interleaved ratio)
        parts.append(m["summary"])
    return ", ".join(parts)


def _groups(records: Iterable[Record]) -> dict[tuple[str, str], list[Record]]:
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.case, r.config), []).append(r)
    return groups


def headline(records: list[Record]) -> list[str]:
    """meshfuse against the same torch calls made directly, one line per configuration."""
    lines = []
    for (case, config), group in _groups(records).items():
        by_name = {r.variant: r for r in group if r.status == "ok"}
        other = next((by_name[n] for n in DIRECT_COUNTERPARTS if n in by_name), None)
        for mf in (by_name.get(n) for n in MESHFUSE_VARIANTS):
            if mf is None or other is None:
                continue
            line = (f"{case} {config}: {MESHFUSE_VARIANTS[mf.variant]} {_num(mf.median_ms)} ms "
                    f"vs {other.variant} {_num(other.median_ms)} ms = "
                    f"{mf.median_ms / other.median_ms:.2f}x")
            if mf.host_us is not None and other.host_us is not None:
                line += (f"; host {mf.host_us:.1f} vs {other.host_us:.1f} us/call: "
                         f"{mf.host_us - other.host_us:+.1f} us "
                         f"({mf.host_us / other.host_us:.2f}x)")
            if "vs_direct_aten" in mf.metrics:
                line += f"; {mf.metrics['vs_direct_aten']:.2f}x bare aten calls"
                if "interleaved_ratio" in mf.metrics:
                    line += f" ({mf.metrics['interleaved_ratio']:.3f}x timed interleaved)"
            if "summary" in mf.metrics and "speedup_over_1gpu" in mf.metrics:
                line += f"; {mf.metrics['summary']}"
            lines.append(line)
    return lines


def _env_line(env: dict[str, Any]) -> str:
    where = f"{env['gpu_name']} x{env['gpu_count']}" if env.get("gpu_name") else (
        f"CPU x{env['world_size']} proc")
    return (f"{where} | torch {env['torch']} | CUDA {env['cuda']} | cuDNN {env['cudnn']} | "
            f"NCCL {env['nccl']} | Python {env['python']} | meshfuse {env['meshfuse_commit']}")


_COLUMNS = ("case", "config", "variant", "med ms", "p10-p90 ms", "x base", "TF/s/GPU",
            "host us", "peak MiB")


def _row(r: Record) -> list[str]:
    spread = "-" if r.p10_ms is None else f"{_num(r.p10_ms)}-{_num(r.p90_ms)}"
    return [r.case, r.config, r.variant, _num(r.median_ms), spread, _ratio(r.ratio),
            _num(r.tflops_per_gpu, 1), _num(r.host_us, 1),
            "-" if r.peak_mib is None else f"{r.peak_mib:.0f}"]


def _console_note(r: Record) -> str:
    if r.status != "ok":
        return f"{r.status.upper()}: {r.message}"[:90]
    note = _extra(r)
    if r.host_us is not None:
        note = f"host {r.host_us:.1f} us" + (f", {note}" if note else "")
    return note[:90]


def _case_header(case: str, rows: list[Record]) -> str:
    skip = {"layout", "op", "size_mib", "n", "rows_per_rank"}
    params = {k: v for k, v in rows[0].params.items() if k not in skip}
    text = " ".join(f"{k}={v}" for k, v in params.items())
    base = next((r.baseline for r in rows if r.baseline), None)
    return f"[{case}] {text}" + (f"; x base = time / {base}'s" if base else "")


def console(records: list[Record], env: dict[str, Any], elapsed_s: float) -> str:
    """The compact summary printed last (it must fit the tail of a log)."""
    widths = (20, 14, 8, 15, 6, 6, 6)
    head = ("config", "variant", "med ms", "p10-p90 ms", "x base", "TF/s", "MiB")
    lines = [(f"== meshfuse benchmarks, world {env['world_size']} | {_env_line(env)} | "
             f"{elapsed_s:.0f} s ==")]
    for case in dict.fromkeys(r.case for r in records):
        rows = [r for r in records if r.case == case]
        lines.append(_case_header(case, rows))
        lines.append(" " + " ".join(c.ljust(w) for c, w in zip(head, widths)) + " notes")
        for r in rows:
            cells = [r.config, r.variant, _num(r.median_ms),
                     "-" if r.p10_ms is None else f"{_num(r.p10_ms)}-{_num(r.p90_ms)}",
                     _ratio(r.ratio), _num(r.tflops_per_gpu, 1),
                     "-" if r.peak_mib is None else f"{r.peak_mib:.0f}"]
            lines.append(" " + " ".join(c.ljust(w) for c, w in zip(cells, widths))
                         + " " + _console_note(r))
    lines.append("-- meshfuse vs the same torch calls made directly (time ratio, >1 = slower) --")
    lines += headline(records) or ["(no meshfuse/direct pair measured)"]
    errors = [r for r in records if r.status == "error"]
    if errors:
        lines.append(f"-- {len(errors)} failed (full messages in the .md and .json) --")
        lines += [f"{r.case} {r.config} {r.variant}: {r.message[:300]}" for r in errors]
    return "\n".join(lines)


def _unwaited_lines(records: list[Record], meta: dict[str, Any]) -> list[str]:
    """A line saying whether the run ended with collectives nobody waited for (torch's exit
    warning "there are still N unwaited collective calls"), and which variants left them."""
    if "torch_unwaited_collectives" not in meta:
        return []
    count = meta["torch_unwaited_collectives"]
    if not count:
        return ["Unwaited collectives at the end: none.", ""]
    by = [f"{r.case} {r.config} {r.variant} ({r.metrics['unwaited_collectives']})"
          for r in records if r.metrics.get("unwaited_collectives")]
    return [f"Unwaited collectives at the end: {count}, left by " + ", ".join(by) + ".", ""]


def markdown(records: list[Record], env: dict[str, Any], meta: dict[str, Any]) -> str:
    out = [f"# meshfuse benchmarks: {meta['stem']}", "", _env_line(env), "",
           (f"Command: `{meta['command']}`; suite time {meta['elapsed_s']:.0f} s. Times are "
            "the slowest rank's median per iteration (p10-p90 over iterations); `x base` is "
            "the time over the baseline's (named per case); TFLOP/s are per GPU; peak memory "
            "is `torch.cuda.max_memory_allocated` (inputs included, less what earlier variants "
            "left allocated: `leftover_mib` in the JSON), max over ranks."), "",
           *_unwaited_lines(records, meta),
           "## meshfuse vs the same torch calls made directly", ""]
    out += [f"- `{line}`" for line in headline(records)] or ["- (none measured)"]
    for case in dict.fromkeys(r.case for r in records):
        rows = [r for r in records if r.case == case]
        base = next((r.baseline for r in rows if r.baseline), None)
        out += ["", f"## {case}" + (f" (baseline: {base})" if base else ""), "",
                "| " + " | ".join(_COLUMNS[1:]) + " | notes |",
                "|" + "---|" * len(_COLUMNS)]
        for r in rows:
            note = _extra(r).replace("|", "/").replace("\n", " ")
            out.append("| " + " | ".join(_row(r)[1:]) + f" | {note} |")
        out += ["", "Parameters:"]
        for config in dict.fromkeys(r.config for r in rows):
            params = next(r.params for r in rows if r.config == config)
            out.append(f"- {config}: " + ", ".join(f"{k}={v}" for k, v in params.items()))
    out += ["", "## Environment", "", "```", json.dumps(env, indent=2), "```", ""]
    return "\n".join(out)


def chart(records: list[Record], env: dict[str, Any], path: str) -> str | None:
    """A PNG of the attention cases' TFLOP/s per GPU, or None without matplotlib/data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = [c for c in ATTENTION_CASES if any(r.case == c and r.tflops_per_gpu for r in records)]
    if not cases:
        return None
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rows = [r for r in records if r.case == case]
        configs = list(dict.fromkeys(r.config for r in rows))
        variants = list(dict.fromkeys(r.variant for r in rows))
        width = 0.8 / max(len(variants), 1)
        for i, variant in enumerate(variants):
            values = []
            for config in configs:
                r = next((r for r in rows if r.config == config and r.variant == variant), None)
                values.append(r.tflops_per_gpu if r and r.tflops_per_gpu else 0.0)
            xs = [c + (i - (len(variants) - 1) / 2) * width for c in range(len(configs))]
            ax.bar(xs, values, width, label=variant)
        ax.set_xticks(range(len(configs)), configs)
        ax.set_ylabel("TFLOP/s per GPU (fwd+bwd)")
        params = rows[0].params
        ax.set_title(f"{case}: b={params.get('b')} h={params.get('h')} s={params.get('s')} "
                     f"head_dim={params.get('head_dim')}, {env['world_size']} rank(s)")
        ax.legend(fontsize="small")
    fig.suptitle(_env_line(env)[:120], fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out_dir: str, records: list[Record], env: dict[str, Any],
          meta: dict[str, Any]) -> list[str]:
    """Writes the JSON, the markdown and (if possible) the PNG; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, meta["stem"])
    payload = {"meta": meta, "env": env, "records": [dataclasses.asdict(r) for r in records]}
    with open(base + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(markdown(records, env, meta))
    paths = [base + ".json", base + ".md"]
    try:
        png = chart(records, env, base + ".png")
    except Exception as e:  # noqa: BLE001 - a chart is never worth losing the results
        print(f"(no chart: {type(e).__name__}: {e})")
        png = None
    if png:
        paths.append(png)
    return paths
