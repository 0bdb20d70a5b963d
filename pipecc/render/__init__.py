"""Pictures of a simulated step: a terminal grid, an SVG Gantt chart, a PNG (through
matplotlib, when installed) and a Chrome/Perfetto trace, all drawn from one `Timeline`."""

from __future__ import annotations
