"""Recipe files: loading one by path or shipped name, and listing the shipped ones."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import RecipeError
from .model import Recipe, parse_recipe

#: The recipes quantkit ships, one ``<name>.toml`` per published layout.
SHIPPED_DIR = Path(__file__).with_name("shipped")
RECIPE_SUFFIX = ".toml"
#: Recipes are a few KB; anything this large is not one (checked before reading it whole).
MAX_RECIPE_BYTES = 1 << 20


def _read(path: Path) -> Recipe:
    size = path.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{size} bytes is too large for a recipe (limit {MAX_RECIPE_BYTES})", path=path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"not UTF-8 text: byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}",
                          path=path) from None
    return parse_recipe(text, path)


def shipped_recipes() -> list[Recipe]:
    """Every shipped recipe, by name.  A shipped file whose ``name`` differs from its file name is an error."""
    recipes = []
    for path in sorted(SHIPPED_DIR.glob(f"*{RECIPE_SUFFIX}")):
        recipe = _read(path)
        if recipe.name != path.stem:
            raise RecipeError(f"shipped recipe is named {recipe.name!r} but its file is {path.name!r}", path=path,
                              field="name")
        recipes.append(recipe)
    return recipes


def load_recipe(spec: str | os.PathLike) -> Recipe:
    """A recipe from a file path, or the shipped recipe of that name (``quantkit recipes`` lists them)."""
    path = Path(spec)
    if path.is_file():
        return _read(path)
    shipped = SHIPPED_DIR / f"{spec}{RECIPE_SUFFIX}"
    if isinstance(spec, str) and os.sep not in spec and shipped.is_file():
        return _read(shipped)
    names = ", ".join(p.stem for p in sorted(SHIPPED_DIR.glob(f"*{RECIPE_SUFFIX}")))
    raise RecipeError(f"no such recipe file, and no shipped recipe of that name (shipped: {names})", path=path)
