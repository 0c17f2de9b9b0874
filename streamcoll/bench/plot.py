"""The sweep's PNG: for every collective, latency (left) and busbw (right)
against message size, one line per library (matplotlib, Agg backend: no
display needed)."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["plot"]

_STYLE = {"streamcoll": dict(color="tab:blue", marker="o"),
          "raw": dict(color="tab:gray", marker=".", linestyle="--"),
          "mpi": dict(color="tab:green", marker="^"),
          "torch": dict(color="tab:red", marker="s")}


def plot(doc: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    meta = doc["meta"]
    groups: Dict[tuple, list] = {}
    for r in rows:
        groups.setdefault(r["collective"], []).append(r)
    colls = list(groups)
    fig, axes = plt.subplots(len(colls), 2, figsize=(10, 2.6 * len(colls) + 0.6), squeeze=False)
    base = meta.get("baseline", "torch")
    for i, c in enumerate(colls):
        ax_t, ax_b = axes[i]
        variants = sorted({(r["dtype"], r["async_op"]) for r in groups[c]})
        for dt, asy in variants:
            rs = sorted((r for r in groups[c] if r["dtype"] == dt and r["async_op"] == asy), key=lambda r: r["bytes"])
            suffix = "" if len(variants) == 1 else f" {dt}{' async' if asy else ''}"
            for lib in ("streamcoll", "raw", "mpi", "torch"):
                pts = [(r["bytes"], r["libs"][lib]) for r in rs if lib in r["libs"]]
                if not pts:
                    continue
                label = {"torch": f"torch.distributed ({base})", "raw": "raw C call",
                         "mpi": "MPI (mpi4py)", "streamcoll": "streamcoll"}[lib] + suffix
                x = [p[0] for p in pts]
                style: Dict[str, Any] = dict(_STYLE[lib])
                if asy:  # async_op=True: dotted, hollow markers
                    style.update(linestyle=":", markerfacecolor="none")
                if len({d for d, _ in variants}) > 1:
                    style["alpha"] = 1.0 - 0.35 * sorted({d for d, _ in variants}).index(dt)
                ax_t.plot(x, [p[1]["time_us"]["median"] for p in pts], label=label, **style)
                ax_b.plot(x, [p[1]["busbw"] for p in pts], label=label, **style)
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel(f"{c}\ntime per call (us)")
        ax_b.set_ylabel("busbw (GB/s)")
        if i == 0:
            ax_b.legend(fontsize=8, loc="upper left")
        if i == len(colls) - 1:
            ax_t.set_xlabel("message size (bytes)")
            ax_b.set_xlabel("message size (bytes)")
    m = meta.get("machine", {})
    vs = "MPI and " if any("mpi" in r["libs"] for r in rows) else ""
    fig.suptitle(f"streamcoll vs {vs}torch.distributed ({base}), {meta.get('world_size')} ranks, "
                 f"{m.get('cpu', '')} x{m.get('nproc', '')}, load {m.get('loadavg_before')}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    _save_small(fig, path)
    plt.close(fig)


def _save_small(fig, path: str) -> None:
    """PNG with a 64-colour palette (a quarter of the size of the RGBA file,
    for results kept in the repository); plain savefig without Pillow."""
    import io
    try:
        from PIL import Image
    except ImportError:
        fig.savefig(path, dpi=72)
        return
    buf = io.BytesIO()
    fig.savefig(buf, dpi=72, format="png")
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)
