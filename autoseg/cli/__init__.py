"""The command line: ``autoseg COMMAND ...`` (the ``autoseg`` script, ``python -m autoseg`` or
``python -m autoseg.cli``).

Owns: ``parser`` (every command's parser, checked when parsed), ``flag_values`` (what each flag's text becomes),
``training_flags`` (plan's and train's flags), ``predict_flags`` (predict's and export-model's flags), ``main`` (one
function per command calling one stage; errors to messages and exit statuses), ``model_commands`` (predict,
export-model, import-nnunet), ``budget`` (the plan's budget from
its flags, what they leave open measured), ``__main__``.
Imports: every package (it is the top layer); nothing imports it.
"""
