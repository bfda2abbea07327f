"""The goodput run as a picture: rank 0's step against time for each launcher, faults marked.

``Trace`` samples a run while it goes (bench/goodput.py's fault driver calls
``sample`` every ``EVERY`` seconds with rank 0's log): the step rank 0 has
reached, where a restart that resumes from an older step shows as a drop.
``draw`` writes one SVG (plain SVG 1.1 text, no plotting library): x is
seconds from the run's first training step, y the step; one colour per
launcher, its run with faults solid, without faults dashed, and each fault
a mark on the solid line.
"""
from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field

EVERY = 0.25   # seconds between samples
STEP_RE = re.compile(r"^step (\d+)/\d+ loss")
ATTEMPT_RE = re.compile(r"^attempt \d+: world size \d+, starting at step (\d+)")
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
W, H, LEFT, RIGHT, TOP, BOTTOM = 900, 420, 70, 190, 40, 50


def step_of(text: str) -> int | None:
    """The step rank 0 is at: its last step line, or where its latest attempt started."""
    for line in reversed(text.splitlines()):
        m = STEP_RE.match(line) or ATTEMPT_RE.match(line)
        if m:
            return int(m.group(1))
    return None


@dataclass
class Trace:
    """(seconds from the run's first step, step) samples, and the faults' times."""
    start: float = 0.0
    points: list = field(default_factory=list)
    _next: float = 0.0

    def sample(self, text_of, now: float | None = None) -> None:
        """Take a sample if one is due; ``text_of()`` reads rank 0's log."""
        now = time.time() if now is None else now
        if now < self._next:
            return
        self._next = now + EVERY
        step = step_of(text_of())
        if step is not None:
            self.points.append((now - self.start, step))

    def at(self, t: float) -> int:
        """The sampled step at ``t`` seconds (the last sample before it)."""
        before = [s for x, s in self.points if x <= t]
        return before[-1] if before else 0


def draw(path: str, title: str, lines: list) -> None:
    """Write the picture to ``path``. ``lines``: (launcher, Trace without faults or None,
    Trace with faults or None, fault times as unix seconds)."""
    xmax = max([x for _, *ts, _ in lines for t in ts if t for x, _ in t.points] + [1.0])
    ymax = max([s for _, *ts, _ in lines for t in ts if t for _, s in t.points] + [1])
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + pw * x / xmax

    def py(y: float) -> float:
        return TOP + ph * (1 - y / ymax)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14">{html.escape(title)}</text>',
           f'<line x1="{LEFT}" y1="{TOP + ph}" x2="{LEFT + pw}" y2="{TOP + ph}" stroke="black"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + ph}" stroke="black"/>']
    for i in range(6):
        x, y = xmax * i / 5, ymax * i / 5
        out.append(f'<text x="{px(x):.1f}" y="{TOP + ph + 16}" text-anchor="middle">'
                   f'{x:.0f}</text>')
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.0f}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 12}" text-anchor="middle">seconds from '
               'the first training step</text>')
    out.append(f'<text x="16" y="{TOP + ph / 2}" text-anchor="middle" transform="rotate(-90 '
               f'16 {TOP + ph / 2})">step (rank 0)</text>')
    for i, (name, calm, hit, kills) in enumerate(lines):
        colour = COLOURS[i % len(COLOURS)]
        for trace, dash in ((calm, ' stroke-dasharray="5,4" stroke-opacity="0.6"'), (hit, "")):
            if trace is None or not trace.points:
                continue
            pts = " ".join(f"{px(x):.1f},{py(s):.1f}" for x, s in trace.points)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} '
                       f'points="{pts}"/>')
        if hit is not None:
            for k in kills:
                t = k - hit.start
                if 0 <= t <= xmax:
                    out.append(f'<circle cx="{px(t):.1f}" cy="{py(hit.at(t)):.1f}" r="3.5" '
                               f'fill="none" stroke="{colour}"/>')
        y = TOP + 14 + 20 * i
        out.append(f'<line x1="{W - RIGHT + 12}" y1="{y - 4}" x2="{W - RIGHT + 36}" '
                   f'y2="{y - 4}" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{W - RIGHT + 42}" y="{y}">{html.escape(name)}</text>')
    y = TOP + 14 + 20 * len(lines) + 10
    out += [f'<text x="{W - RIGHT + 12}" y="{y}">solid: with faults</text>',
            f'<text x="{W - RIGHT + 12}" y="{y + 16}">dashed: without</text>',
            f'<text x="{W - RIGHT + 12}" y="{y + 32}">o: a fault</text>', '</svg>']
    with open(path, "w") as fh:
        fh.write("\n".join(out) + "\n")
