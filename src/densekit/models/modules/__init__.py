"""Parameter-efficient modules: small trainable parts added to a frozen encoder, f'(x) = f_θ(x) + f_φ(x).

A module is built from a spec (`specs`: one of the registered kinds', told apart by `type`) on a tower
that shares every base tensor (`tower`). Each kind is one file of `kinds/`, registered with
`kind.register_module_kind`; it builds, saves, loads, folds and averages its modules, through its
family's base (`peft_kind` for the kinds peft provides, `own_kind` for densekit's own). `module` saves
and loads one as a small folder that names its base, and `sizing` refuses one larger than its base.
"""
