"""Self-contained SVG charts from the Python standard library alone (the GPU machine has PyTorch but
no matplotlib): the few kinds benchmarks/compare.py draws, namely line panels, grouped bar panels
(vertical or horizontal, with a value on each bar and per-group markers), a legend row and notes.

Coordinates are pixels from the top left. A Figure collects the elements and works out its own
height when saved, so that the notes (failed runs, left-out files) always fit below the panels.
Ticks are "nice": 1, 2 or 5 x 10^k apart.
"""
import math
import re
import textwrap
from xml.sax.saxutils import escape, quoteattr

FONT = 12
EM = 0.56  # the average width of a sans-serif character, in em: enough to lay out labels
INK, GREY, GRID = "#222222", "#666666", "#e4e4e4"

# XML 1.0 has no place for most control characters, and an error message may carry any of them.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def finite(x):
    """x as a float when it is a finite number, else None (a JSON null, a NaN, a string)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def text_width(s, size=FONT):
    return len(s) * size * EM


def nice_step(span, count):
    """The 1, 2 or 5 x 10^k step that cuts span into about count intervals."""
    raw = span / max(count, 1)
    k = math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * 10.0 ** k >= raw * (1 - 1e-9):
            return m * 10.0 ** k
    return 10.0 ** (k + 1)


def nice_ticks(lo, hi, count=5, integer=False):
    """Ticks covering [lo, hi] (the first at or below lo, the last at or above hi) and their step."""
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo <= abs(hi) * 1e-12:  # one value: give it some room either side
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step(hi - lo, count)
    if integer:
        step = max(1.0, round(step))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    digits = decimals(step)
    return [round(i * step, digits + 2) for i in range(first, last + 1)], step


def decimals(step):
    """How many decimals a tick label needs at this step."""
    return max(0, -math.floor(math.log10(step) + 1e-9))


def tick_label(v, step):
    return f"{v:.{decimals(step)}f}" if step < 1e6 else f"{v:g}"


def value_label(v):
    """A value printed on a bar: three significant digits, no exponent for the usual magnitudes."""
    if v == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(v))))
    return f"{v:.{min(digits, 6)}f}" if 1e-4 <= abs(v) < 1e7 else f"{v:.2e}"


class Scale:
    """Maps the data interval [lo, hi] onto the pixel interval [p0, p1] (p1 < p0 for a y axis)."""

    def __init__(self, lo, hi, p0, p1):
        self.lo, self.hi, self.p0, self.p1 = lo, hi, p0, p1

    def __call__(self, v):
        return self.p0 + (v - self.lo) / (self.hi - self.lo) * (self.p1 - self.p0)


class Figure:
    def __init__(self, width, title, subtitle=""):
        self.width = width
        self.items = []
        self.notes = []
        self.bottom = 0.0  # the lowest point drawn so far: the notes go below it
        self.top = 8
        for line in wrap(title, width - 30, 15):
            self.top += 18
            self.text(width / 2, self.top, line, size=15, anchor="middle", weight="bold")
        self.top += 14
        if subtitle:
            for line in wrap(subtitle, width - 40, FONT)[:2]:
                self.text(width / 2, self.top + 4, line, anchor="middle", fill=GREY)
                self.top += 16
        self.top += 6

    # Elements. Every string goes through escape/quoteattr: labels come from the JSON files.
    def _add(self, tag, attrs, body=None, bottom=None):
        a = "".join(f" {k.replace('_', '-')}={quoteattr(clean(str(v)))}" for k, v in attrs.items()
                    if v is not None)
        self.items.append(f"<{tag}{a}/>" if body is None else f"<{tag}{a}>{escape(clean(body))}</{tag}>")
        if bottom is not None:
            self.bottom = max(self.bottom, bottom)

    def line(self, x1, y1, x2, y2, stroke=INK, width=1, dash=None):
        self._add("line", dict(x1=r(x1), y1=r(y1), x2=r(x2), y2=r(y2), stroke=stroke, stroke_width=width,
                               stroke_dasharray=dash), bottom=max(y1, y2))

    def rect(self, x, y, w, h, fill, stroke=None, opacity=None):
        self._add("rect", dict(x=r(x), y=r(y), width=r(max(w, 0)), height=r(max(h, 0)), fill=fill,
                               stroke=stroke, fill_opacity=opacity), bottom=y + h)

    def polyline(self, points, stroke, width=2, dash=None):
        self._add("polyline", dict(points=" ".join(f"{r(x)},{r(y)}" for x, y in points), fill="none",
                                   stroke=stroke, stroke_width=width, stroke_dasharray=dash,
                                   stroke_linejoin="round"))

    def circle(self, x, y, radius, fill):
        self._add("circle", dict(cx=r(x), cy=r(y), r=radius, fill=fill))

    def text(self, x, y, s, size=FONT, anchor="start", fill=INK, weight=None, rotate=False, halo=False):
        """halo: a white outline under the glyphs, for a label that may cross a line or a marker."""
        transform = f"rotate(-90 {r(x)} {r(y)})" if rotate else None
        outline = (dict(stroke="white", stroke_width=3, paint_order="stroke", stroke_linejoin="round")
                   if halo else {})
        self._add("text", dict(x=r(x), y=r(y), font_size=size, text_anchor=anchor, fill=fill,
                               font_weight=weight, transform=transform, **outline), s,
                  bottom=y + size * 0.3)

    def legend(self, entries):
        """One row (or more, when it does not fit) of (label, colour, kind) under the title; kind is
        "box" (a bar), "line" (a line with a dot), "dash" (a dashed line) or "tick" (a marker)."""
        rows, row, used = [], [], 0.0
        for label, colour, kind in entries:
            w = 30 + text_width(label) + 18
            if row and used + w > self.width - 40:
                rows.append((row, used))
                row, used = [], 0.0
            row.append((label, colour, kind, w))
            used += w
        if row:
            rows.append((row, used))
        for row, used in rows:
            x, y = (self.width - used) / 2, self.top + 10
            for label, colour, kind, w in row:
                if kind == "box":
                    self.rect(x + 8, y - 6, 14, 12, colour)
                elif kind == "tick":
                    self.line(x + 15, y - 8, x + 15, y + 8, colour, 3)
                else:
                    self.line(x + 2, y, x + 26, y, colour, 2, "5,3" if kind == "dash" else None)
                    if kind == "line":
                        self.circle(x + 14, y, 3, colour)
                self.text(x + 30, y + 4, label)
                x += w
            self.top += 20
        self.top += 6

    def note(self, s):
        """A line of text under the panels (a run left out and why)."""
        self.notes.append(s)

    def svg(self):
        lines = [line for n in self.notes for line in wrap(n, self.width - 30, FONT)[:3]]
        y = self.bottom + 22
        for line in lines:
            self.text(15, y, line, fill=GREY)
            y += 16
        height = math.ceil(y + 4)
        return "\n".join(
            [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{height}" '
             f'viewBox="0 0 {self.width} {height}" font-family="sans-serif" font-size="{FONT}">',
             f'<rect x="0" y="0" width="{self.width}" height="{height}" fill="white"/>']
            + self.items + ["</svg>", ""])

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write('<?xml version="1.0" encoding="UTF-8"?>\n' + self.svg())


def r(x):
    return round(x, 1)


def clean(s):
    return _NOT_XML.sub("?", s)


def wrap(s, width_px, size):
    """s cut into lines of at most width_px; a third line that is not the last ends in '...'."""
    lines = textwrap.wrap(s, max(10, int(width_px / (size * 0.6)))) or [""]  # 0.6: wide glyphs too
    if len(lines) > 3:
        lines = lines[:3]
        lines[2] = lines[2][:-3] + "..."
    return lines


def _title(fig, x, y, w, title):
    if title:
        fig.text(x + w / 2, y - 8, title, size=13, anchor="middle", weight="bold")


def _axes(fig, x, y, w, h):
    fig.line(x, y + h, x + w, y + h, INK)
    fig.line(x, y, x, y + h, INK)


def line_panel(fig, box, series, title="", xlabel="", ylabel="", shade=None, message=""):
    """A line chart in box = (x, y, w, h), the plot area (labels go outside it).

    series: (label, colour, [(x, y), ...], dash or None); a y that is not a finite number breaks the
    line. A dashed line drawn after a solid one lets both show where they coincide.
    shade: (x0, x1, label), a grey band (the warm-up steps). message: said in an empty panel.
    """
    x, y, w, h = box
    points = [(px, py) for _, _, pts, _ in series for px, py in pts if finite(px) is not None
              and finite(py) is not None]
    _title(fig, x, y, w, title)
    if not points:
        _axes(fig, x, y, w, h)
        fig.text(x + w / 2, y + h / 2, message or "no data", anchor="middle", fill=GREY)
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    xticks, xstep = nice_ticks(min(xs), max(xs), max(2, min(8, int(w / 60))), integer=True)
    yticks, ystep = nice_ticks(min(ys), max(ys), max(2, int(h / 45)))
    sx, sy = Scale(xticks[0], xticks[-1], x, x + w), Scale(yticks[0], yticks[-1], y + h, y)
    if shade and shade[1] > shade[0]:
        x0, x1 = sx(max(shade[0], xticks[0])), sx(min(shade[1], xticks[-1]))
        fig.rect(x0, y, x1 - x0, h, "#eeeeee")
        fig.text(x0 + 4, y + 14, shade[2], fill=GREY)
    for t in yticks:
        fig.line(x, sy(t), x + w, sy(t), GRID)
        fig.line(x - 4, sy(t), x, sy(t))
        fig.text(x - 7, sy(t) + 4, tick_label(t, ystep), anchor="end")
    for t in xticks:
        fig.line(sx(t), y + h, sx(t), y + h + 4)
        fig.text(sx(t), y + h + 17, tick_label(t, xstep), anchor="middle")
    _axes(fig, x, y, w, h)
    for _, colour, pts, dash in series:
        segment = []
        dots = len(pts) <= 40  # dots help read a few steps and clutter many
        for px, py in list(pts) + [(None, None)]:
            if finite(px) is None or finite(py) is None:
                if len(segment) > 1:
                    fig.polyline(segment, colour, dash=dash)
                segment = []
                continue
            segment.append((sx(px), sy(py)))
            if dots:
                fig.circle(sx(px), sy(py), 2.5, colour)
    _axis_labels(fig, x, y, w, h, xlabel, ylabel)


def _axis_labels(fig, x, y, w, h, xlabel, ylabel, ylabel_offset=48):
    if xlabel:
        fig.text(x + w / 2, y + h + 36, xlabel, anchor="middle")
    if ylabel:
        fig.text(x - ylabel_offset, y + h / 2, ylabel, anchor="middle", rotate=True)


def bar_panel(fig, box, categories, series, title="", fmt_value=value_label, axis_label="",
              horizontal=False, markers=(), lines=(), category_notes=None, missing="n/a"):
    """Grouped bars in box = (x, y, w, h), the plot area; one group per category, one bar per series.

    series: (label, colour, [value per category]); a value that is not a finite number draws no
    bar and prints `missing` (an empty string prints nothing). Each bar carries its value.
    markers: (category index, value, colour), a thick line across that group at value (a target,
    a budget). lines: (value, colour, label), a dashed line across the whole panel (a reference).
    category_notes: {category index: text} printed under (or after) the category's name.
    Vertical bars grow up from 0 with the categories along the bottom; horizontal ones grow right
    with the categories down the left side (long names fit there).
    """
    x, y, w, h = box
    category_notes = category_notes or {}
    values = [v for _, _, vs in series for v in (finite(v) for v in vs) if v is not None]
    values += [finite(m[1]) for m in markers if finite(m[1]) is not None]
    values += [finite(line[0]) for line in lines if finite(line[0]) is not None]
    _title(fig, x, y, w, title)
    if not categories:
        _axes(fig, x, y, w, h)
        fig.text(x + w / 2, y + h / 2, "no data", anchor="middle", fill=GREY)
        return
    lo, hi = min(values + [0.0]), max(values + [0.0])
    if lo == hi == 0.0:  # nothing to draw but the "n/a"s: an axis from 0 to 1 rather than around 0
        hi = 1.0
    elif hi > 0:
        hi *= 1.12 if not horizontal else 1.18  # room for the value printed past the longest bar
    length = w if horizontal else h
    ticks, step = nice_ticks(lo, hi, max(2, int(length / (70 if horizontal else 45))))
    n_groups, n_bars = len(categories), max(1, len(series))
    span = h if horizontal else w
    group = span / n_groups
    bar = group * 0.78 / n_bars
    if horizontal:
        s = Scale(ticks[0], ticks[-1], x, x + w)
        for t in ticks:
            fig.line(s(t), y, s(t), y + h, GRID)
            fig.line(s(t), y + h, s(t), y + h + 4)
            fig.text(s(t), y + h + 17, tick_label(t, step), anchor="middle")
    else:
        s = Scale(ticks[0], ticks[-1], y + h, y)
        for t in ticks:
            fig.line(x, s(t), x + w, s(t), GRID)
            fig.line(x - 4, s(t), x, s(t))
            fig.text(x - 7, s(t) + 4, tick_label(t, step), anchor="end")
    zero = s(0.0)
    labels = []  # drawn last, over the markers and lines
    for gi, name in enumerate(categories):
        g0 = (y if horizontal else x) + gi * group + group * 0.11
        note = category_notes.get(gi, "")
        if horizontal:
            mid = y + gi * group + group / 2
            fig.text(x - 8, mid + (4 if not note else -2), name, anchor="end")
            if note:
                fig.text(x - 8, mid + 12, note, anchor="end", fill=GREY, size=11)
        else:
            mid = x + gi * group + group / 2
            fig.text(mid, y + h + 17, name, anchor="middle")
            if note:
                fig.text(mid, y + h + 31, note, anchor="middle", fill=GREY, size=11)
        for si, (_, colour, vs) in enumerate(series):
            v = finite(vs[gi]) if gi < len(vs) else None
            b0 = g0 + si * bar
            if v is None:
                if missing:
                    if horizontal:
                        labels.append((zero + 4, b0 + bar / 2 + 4, missing, dict(fill=GREY)))
                    else:
                        labels.append((b0 + bar / 2, zero - 4, missing, dict(anchor="middle", fill=GREY)))
                continue
            label = fmt_value(v)
            if horizontal:
                end = s(v)
                fig.rect(min(zero, end), b0 + 1, abs(end - zero), bar - 2, colour)
                labels.append((max(zero, end) + 4, b0 + bar / 2 + 4, label, {}))
            else:
                top = s(v)
                fig.rect(b0 + 1, min(zero, top), bar - 2, abs(top - zero), colour)
                if text_width(label, 11) <= bar + 4:
                    labels.append((b0 + bar / 2, min(zero, top) - 4, label, dict(anchor="middle")))
                else:  # too wide to sit over a narrow bar: stand it up
                    labels.append((b0 + bar / 2 + 4, min(zero, top) - 4, label, dict(rotate=True)))
        for mi, mv, colour in markers:
            mv = finite(mv)
            if mi != gi or mv is None:
                continue
            if horizontal:
                fig.line(s(mv), g0 - 3, s(mv), g0 + n_bars * bar + 3, colour, 3)
            else:
                fig.line(g0 - 3, s(mv), g0 + n_bars * bar + 3, s(mv), colour, 3)
    for v, colour, label in lines:
        v = finite(v)
        if v is None:
            continue
        if horizontal:
            fig.line(s(v), y, s(v), y + h, colour, 1.5, "6,4")
            fig.text(s(v) + 3, y - 4 if not title else y + 12, label, fill=colour, size=11)
        else:
            fig.line(x, s(v), x + w, s(v), colour, 1.5, "6,4")
            fig.text(x + w - 3, s(v) - 4, label, anchor="end", fill=colour, size=11)
    for lx, ly, label, style in labels:
        if not style.get("rotate"):  # a white box under the label interrupts a marker or line crossing it
            tw = text_width(label, 11)
            left = lx - (tw / 2 if style.get("anchor") == "middle" else 0)
            fig.rect(left - 1, ly - 10, tw + 2, 13, "white", opacity=0.85)
        fig.text(lx, ly, label, size=11, halo=True, **style)
    if horizontal:
        fig.line(zero, y, zero, y + h, INK)
        fig.line(x, y + h, x + w, y + h, INK)
        _axis_labels(fig, x, y, w, h, axis_label, "")
    else:
        fig.line(x, zero, x + w, zero, INK)
        fig.line(x, y, x, y + h, INK)
        _axis_labels(fig, x, y, w, h, "", axis_label)
