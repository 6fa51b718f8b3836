"""Links between ranks: names (:mod:`.spec`) and their emulation with network namespaces (:mod:`.netns`)."""
from sparsecomm.links.spec import Link, parse_link

__all__ = ["Link", "parse_link"]
