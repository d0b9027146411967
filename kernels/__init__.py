"""Kernels (`h3gen.kernels`). Each fast op sits next to a plain-torch reference with the same signature; the public
function of an op picks the fast path on CUDA and the reference elsewhere. The attention dispatch is
`h3gen.kernels.attention.attention`; the package itself imports nothing, so its light modules (the backend names in
`attention_backends`) load without torch."""

if __name__ == "kernels":  # a bare import from the checkout root: the installed `kernels` stands in
    from h3gen.checkout_names import defer_to_installed

    defer_to_installed(__name__, __file__)
