import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.families.profile.report import metric_heatmaps
from bertology.render.html import Figure, Report, Section


def test_report_embeds_figures_and_escapes_text(tmp_path):
    heads = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "metric": "sep", "value": [0.1, 0.2, 0.3, 0.4]})
    with RunFolder(tmp_path / "run") as folder:
        png = folder.write_figure("heatmaps", metric_heatmaps(heads, ["sep"]))
    png = tmp_path / "run" / png.name
    hostile = '"><img src=x onerror=alert(1)><script>alert(1)</script>'
    report = Report(
        title=f"run on {hostile}",
        summary={"corpus": hostile},
        sections=[Section(title="S", intro=hostile, figures=[Figure(png, hostile)], tables=[("t", pd.DataFrame({"text": [hostile]}))])],
    )
    html = report.render()
    assert "<script>" not in html and "<img src=x" not in html
    # title (<title> and <h1>), summary, intro, figure (alt and caption), table cell
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 7
    assert html.count("data:image/png;base64,iVBOR") == 1  # PNG magic, base64-encoded


def test_pivoted_tables_have_no_empty_axis_column():
    long = pd.DataFrame({"layer": [0, 0, 1, 1], "metric": ["cls", "sep", "cls", "sep"], "value": [0.1, 0.2, 0.3, 0.4]})
    wide = long.pivot(index="layer", columns="metric", values="value").reset_index()
    html = Report(title="t", summary={}, sections=[Section(title="S", tables=[("wide", wide)])]).render()
    header = html[html.index("<thead>") : html.index("</thead>")]
    assert header.count("<th>") == 3 and ">metric<" not in header  # layer, cls, sep
