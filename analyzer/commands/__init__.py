"""One module per `megascope` verb, each with ``main(argv) -> int``."""
