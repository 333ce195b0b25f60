"""Parameter-efficient modules: small trainable parts added to a frozen encoder, f'(x) = f_θ(x) + f_φ(x).

A module is built from a spec (`specs`), on a tower that shares every base tensor (`tower`), by peft
for the kinds peft has (`peft_kinds`) or by densekit for the rest (`own_kinds`); `module` saves and
loads one as a small folder that names its base.
"""
