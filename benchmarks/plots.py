"""How every benchmark figure is drawn (figures.py says what each one shows): measured values
only, as bars grouped by what was measured (blocks per call, a case), never a line from one
measured point to the next; the reference a value is held against beside it, as a gray bar
where it was measured for each group and as a labelled black line where it is one number;
the question the figure answers in its title; a short legend under each panel.  Plain
Python and matplotlib: it reads CSVs and draws, it times nothing."""

import csv
import math
import statistics
from dataclasses import dataclass

NO_MATPLOTLIB = "no PNG: matplotlib is not installed (pip install matplotlib)"
REFERENCE_GRAYS = ("0.5", "0.75")        # the gray bars of measured references, in order
BACK = "///"                             # the hatch of bars that move the other way
LIMIT_STYLE = dict(color="black", linewidth=1.4)
TARGET_STYLE = dict(color="black", linewidth=1.0, linestyle="--")
HEADROOM = 1.12                          # the y axis ends this far above the highest bar or line
GROUP_WIDTH = 0.8                        # of the 1.0 between two groups' centres
MAX_LABELLED_BARS = 24                   # bars of a panel up to which each bar shows its value
DPI = 100


@dataclass
class Bars:
    """One kind of bar: its legend label and its measured value in each group it was
    measured in (a group without one gets no bar from it)."""
    label: str
    values: dict              # group key -> value
    color: str
    hatch: str = ""


@dataclass
class Points:
    """Measured (x, y) pairs of one kind, drawn as markers that no line joins."""
    label: str
    xy: list
    color: str
    marker: str = "o"


@dataclass
class Limit:
    """A reference that is one number: a horizontal line across the panel."""
    label: str
    values: tuple             # one line per value, one legend entry for them all
    style: dict = None


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def number(value):
    """A value as a figure or a table shows it: 1,987 from 100 up, 41.1 from 1 up, else two
    significant digits (0.04)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def median_by(pairs):
    """{key: median of its values} of (key, value) pairs."""
    by = {}
    for key, value in pairs:
        by.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in by.items()}


def read_rows(path):
    """The rows of a benchmark CSV, whole numbers as ints and other numbers as floats, the
    rest as written ("" stays "")."""
    def value(text):
        if text.lstrip("-").isdigit():
            return int(text)
        try:
            return float(text)
        except ValueError:
            return text
    with open(path, newline="") as f:
        return [{column: value(text or "") for column, text in row.items()} for row in csv.DictReader(f)]


def new_figure(plt, count, columns, question, where, width=6.4, height=4.6):
    """A figure of `count` panels, `columns` a row, titled with its question and, under it,
    where and what was measured.  Returns (figure, the panels' axes)."""
    columns = min(columns, count)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False,
                                constrained_layout=True)
    axes = list(axes.flat)
    for spare in axes[count:]:
        spare.remove()
    figure.suptitle(f"{question}\n{where}", fontsize=11)
    return figure, axes[:count]


def grouped_bars(ax, groups, bars, limits=(), title="", xlabel="", ylabel=""):
    """Bars side by side in each group (groups: [(key, tick label)]), only those measured
    there; the limits as horizontal lines; the legend under the panel.  A panel of few bars
    writes each bar's value on it."""
    present = [[b for b in bars if b.values.get(key) is not None] for key, _ in groups]
    width = GROUP_WIDTH / max([len(p) for p in present] + [1])
    count = sum(len(p) for p in present)
    seen, highest = set(), [0.0]
    for g, mine in enumerate(present):
        for i, b in enumerate(mine):
            value = b.values[groups[g][0]]
            drawn = ax.bar(g + (i - (len(mine) - 1) / 2) * width, value, width, color=b.color, hatch=b.hatch,
                           edgecolor="white", linewidth=0.5, label=None if b.label in seen else b.label)
            seen.add(b.label)
            highest.append(value)
            if count <= MAX_LABELLED_BARS:
                ax.bar_label(drawn, [number(value)], fontsize=7, padding=1, rotation=90 if count > 8 else 0)
    highest += draw_limits(ax, limits)
    ax.set_xticks(range(len(groups)), [text for _, text in groups])
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_ylim(0, HEADROOM * max(highest) * (1.08 if count <= MAX_LABELLED_BARS else 1) or 1)
    finish(ax, title, xlabel, ylabel)


def draw_limits(ax, limits):
    """Each limit's lines, one legend entry a limit; returns the values drawn."""
    values = []
    for limit in limits:
        for i, value in enumerate(limit.values):
            ax.axhline(value, **(limit.style or LIMIT_STYLE), label=None if i else limit.label)
            values.append(value)
    return values


def measured_points(ax, points, limits=(), title="", xlabel="", ylabel=""):
    """Each measured point a marker, none joined to the next (the values between were not
    measured); the limits as horizontal lines; both axes from 0."""
    highest, widest = [0.0], [0.0]
    for p in points:
        ax.scatter(*zip(*p.xy), color=p.color, marker=p.marker, s=30, label=p.label)
        highest += [y for _, y in p.xy]
        widest += [x for x, _ in p.xy]
    highest += draw_limits(ax, limits)
    ax.set_xlim(0, HEADROOM * max(widest) or 1)
    ax.set_ylim(0, HEADROOM * max(highest) or 1)
    finish(ax, title, xlabel, ylabel, grid_axis="both")


def finish(ax, title, xlabel, ylabel, grid_axis="y"):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis=grid_axis, alpha=0.3)
    ax.set_axisbelow(True)
    handles, labels = ax.get_legend_handles_labels()
    # What was measured first, then the lines of what it is held against.
    order = sorted(range(len(handles)), key=lambda i: type(handles[i]).__name__ == "Line2D")
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, loc="upper left",
              bbox_to_anchor=(0, -0.16), frameon=False)


def save(figure, path):
    figure.savefig(path, dpi=DPI)
    pyplot().close(figure)
