"""Model pipelines (`h3gen.pipelines`): `h3` for MiniMax-H3."""
