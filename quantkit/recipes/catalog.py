"""Recipe files: loading one by path or shipped name, and listing the shipped ones."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import RecipeError
from .model import Recipe, parse_recipe

#: The recipes quantkit ships, one ``<name>.toml`` per published layout.
SHIPPED_DIR = Path(__file__).with_name("shipped")
#: The bundled example model's recipes (``quantkit demo``); nameable like shipped ones (``--recipe tiny-moe-q4_k``).
EXAMPLE_DIR = Path(__file__).resolve().parent.parent / "examples" / "recipes"
#: Where a recipe name is looked up, in order.
NAMED_DIRS = (SHIPPED_DIR, EXAMPLE_DIR)
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


def shipped_recipes(directory: Path = SHIPPED_DIR) -> list[Recipe]:
    """Every shipped recipe (or example recipe, ``directory=EXAMPLE_DIR``), by name.  A file whose ``name`` differs
    from its file name is an error."""
    recipes = []
    for path in sorted(directory.glob(f"*{RECIPE_SUFFIX}")):
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
    if path.is_dir():
        raise RecipeError("is a directory; a recipe is a TOML file or a shipped recipe's name", path=path)
    if isinstance(spec, str) and os.sep not in spec:
        for directory in NAMED_DIRS:
            named = directory / f"{spec}{RECIPE_SUFFIX}"
            if named.is_file():
                return _read(named)
    names = ", ".join(p.stem for d in NAMED_DIRS for p in sorted(d.glob(f"*{RECIPE_SUFFIX}")))
    raise RecipeError(f"no such recipe file, and no shipped recipe or example recipe of that name ({names})",
                      path=path)
