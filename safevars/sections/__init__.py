"""Critical sections inside ``tf.function`` (see :mod:`safevars.sections.section`)."""

from safevars.sections.section import _enclosing_sections as _enclosing_sections
from safevars.sections.section import (
    body_wrappers,
    defer_count,
    graph_body_wrappers,
    graph_inputs,
    graph_section,
    held_in_graph,
    record_xla_preparation,
)

__all__ = [
    "body_wrappers",
    "defer_count",
    "graph_body_wrappers",
    "graph_inputs",
    "graph_section",
    "held_in_graph",
    "record_xla_preparation",
]
