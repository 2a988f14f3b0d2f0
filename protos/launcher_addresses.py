"""A launcher address list: "HOST:PORT" or, for replicas (launcher/leader.py), several joined by
commas. Clients (launcher/client.py) and trainers (the handoff's `launcher`) read it the same
way: every address in turn, moving on when one is down or is not the leader. Torch-free."""


def split(addresses: str) -> list[str]:
    """The addresses of `addresses`, in order, blanks dropped."""
    return [a.strip() for a in addresses.split(",") if a.strip()]


def join(addresses: list[str]) -> str:
    """One list of `addresses`, each once, in their first order."""
    return ",".join(dict.fromkeys(a for a in addresses if a))
