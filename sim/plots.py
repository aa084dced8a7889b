"""PNG plots of simulation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from gearshift.sim.engine import SimResult


def write_plots(results: list[SimResult], folder: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{results[0].trace} on {results[0].cluster.label()}" if results else ""
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        recs = res.records if res.tracked is None else [r for r in res.records if r.job.job_id in res.tracked]
        jct = sorted((r.finish - r.job.submit) / 3600 for r in recs if r.finish is not None)
        if jct:
            ax.step(jct, [(i + 1) / len(jct) for i in range(len(jct))], where="post", label=res.policy)
    ax.set_xscale("log")
    ax.set_xlabel("JCT (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"JCT CDF — {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "jct_cdf.png", plt))

    for col, name, label in ((1, "gpu_util.png", "GPUs allocated (%)"), (2, "queue_length.png", "jobs waiting")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for res in results:
            tl = res.timeline
            if not tl:
                continue
            xs = [row[0] / 3600 for row in tl]
            ys = [row[col] * (100 / res.cluster.gpus if col == 1 else 1) for row in tl]
            ax.step(xs, ys, where="post", label=res.policy, linewidth=1)
        ax.set_xlabel("time (hours)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} — {title}")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, out / name, plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
