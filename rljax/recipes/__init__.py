"""The shipped recipes: ml_collections config files, each a ``get_config()``.

``rljax train --config=<name>`` takes any of them by name (or a config file's path). Every recipe
starts from :mod:`rljax.recipes.default` (exactly the defaults of :class:`rljax.run.config.RunConfig`)
and changes what it needs.
"""
