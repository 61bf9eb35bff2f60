"""The command line: ``autoseg COMMAND ...`` (the ``autoseg`` script, ``python -m autoseg`` or
``python -m autoseg.cli``).

Owns: ``parser`` (every flag, checked when parsed), ``main`` (one function per command calling one stage;
errors to messages and exit statuses), ``__main__``.
Imports: every package (it is the top layer); nothing imports it.
"""
