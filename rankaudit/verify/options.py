"""The `--verify` option: its choices and its help, read from the verifier registry when click asks for them."""

from __future__ import annotations

import click


class VerifierChoice(click.Choice):
    """--verify's choices: the registry's names (rankaudit.verify.registry), read when click asks for them."""

    def __init__(self):
        super().__init__(())

    @property
    def choices(self):
        from rankaudit.verify import registry

        return tuple(registry.names())

    @choices.setter
    def choices(self, value):
        pass  # click.Choice.__init__ sets them; the registry holds them


class VerifyOption(click.Option):
    """--verify: its help is each registered verifier's sentence (rankaudit.verify.registry.help_text)."""

    @property
    def help(self):
        from rankaudit.verify import registry

        return registry.help_text()

    @help.setter
    def help(self, value):
        pass
