"""What every figure and report shares: plotting helpers and the self-contained HTML report.

:mod:`.figures` holds the helpers the families' and studies' figures use (each draws its own figures in its room);
:mod:`.html` renders the report's sections, with no network needed to open it.
"""
