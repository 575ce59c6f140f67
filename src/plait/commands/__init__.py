"""What plait.cli's own verbs do, one module per verb, each imported only when its verb runs (plait.cli names them
as "plait.commands.<verb>:cmd_<verb>"): the module imports at its top whatever its verb needs, torch included.

The subsystems' verbs live the same way in their own packages: `<package>/cli.py` declares the parser,
`<package>/commands.py` runs it (plait.plan, plait.launch, plait.tune, ...).
"""
