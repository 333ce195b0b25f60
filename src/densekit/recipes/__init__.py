"""Recipes: YAML pipelines of steps (mine, train, encode, index, search, evaluate) that resume."""
