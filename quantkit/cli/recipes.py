"""``quantkit recipes``: the shipped recipes, with their architectures and name tags."""
from __future__ import annotations

import json
import textwrap

import click

#: Width of the wrapped recipe descriptions.
DESCRIPTION_WIDTH = 100


@click.command("recipes")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="print as JSON")
def recipes(name, as_json):
    """List the shipped recipes (and the example model's); with NAME (a recipe name or file), show that recipe."""
    from ..recipes import load_recipe, shipped_recipes
    from ..recipes.catalog import EXAMPLE_DIR

    if name is not None:
        recipe = load_recipe(name)
        click.echo(json.dumps(recipe.to_dict(), indent=1) if as_json else recipe.text.rstrip("\n"))
        return
    listed, examples = shipped_recipes(), shipped_recipes(EXAMPLE_DIR)
    if as_json:   # the same recipes as the listing: the example ones are --recipe names too
        keys = ("name", "architectures", "name_tag", "description", "path", "sha256")
        click.echo(json.dumps([{**{k: r.to_dict()[k] for k in keys}, "example": r in examples}
                               for r in [*listed, *examples]], indent=1))
        return
    for r in [*listed, None, *examples]:
        if r is None:
            click.echo("\nexample recipes (for the bundled tiny model, quantkit demo):")
            continue
        click.echo(r.name)
        click.echo(f"    architectures  {', '.join(r.architectures)}")
        click.echo(f"    name tag       {r.name_tag}")
        for line in textwrap.wrap(r.description, DESCRIPTION_WIDTH):
            click.echo(f"    {line}")


COMMANDS = [recipes]
