"""Model pipelines (`h3gen.pipelines`): `h3` for MiniMax-H3."""

if __name__ == "pipelines":  # a bare import from the checkout root: the installed `pipelines` stands in
    from h3gen.checkout_names import defer_to_installed

    defer_to_installed(__name__, __file__)
