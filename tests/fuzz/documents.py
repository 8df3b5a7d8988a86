"""Mutations of JSON documents the fuzz tests share: every path into a document, and a copy with one value changed."""

import json


def paths(value, prefix=()):
    """Every path to a value inside a JSON document."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            yield from paths(item, prefix + (index,))


DELETE = object()


def changed(document, path, new):
    """A copy of ``document`` with the value at ``path`` replaced by ``new`` (or its key deleted: :data:`DELETE`)."""
    if not path:
        return new
    copy = json.loads(json.dumps(document))
    target = copy
    for step in path[:-1]:
        target = target[step]
    if new is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = new
    return copy
