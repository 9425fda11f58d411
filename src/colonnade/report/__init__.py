"""Run reports: `report.json` and `report.html`, rebuilt from the store alone."""

from .build import build_report, read_launch
from .html import render_html

__all__ = ["build_report", "read_launch", "render_html"]
