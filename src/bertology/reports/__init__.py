"""Figures and the self-contained HTML report."""

from bertology.reports.html import Figure, Report, Section

__all__ = ["Figure", "Report", "Section"]
