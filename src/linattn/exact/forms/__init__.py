"""The exact part's forms: the window + sinks op, beside a linear part of any kind, and the sparse cache."""
