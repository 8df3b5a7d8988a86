"""The report's link to the attention viewer: a layer x head grid, each cell opening that head."""

from __future__ import annotations

from bertology.render.html import Section


def viewer_section(view, href: str = "viewer.html") -> Section:
    section = Section(
        title="Attention viewer",
        intro=(f"viewer.html shows every head's attention on the corpus's first example ({len(view.tokens)} tokens): "
               "a head view with lines from each token to those it attends, and a model view of every head. "
               "Click a head below to open it there."),
    )
    if len(view.stored_layers) < view.layers:
        section.notes.append(f"The viewer holds the maps of layers {view.stored_layers[0]} to {view.stored_layers[-1]} of {view.layers}: computing every "
                             "layer's on this model and input would take long (its budget of map cells); a head of another layer names the "
                             "`bertology view --layers` command that draws it.")
    section.head_links = (href, view.layers, view.heads)
    return section
