from analyzer.cli import main

if __name__ == "__main__":  # not when a spawned process (a watch's full looks) imports it
    raise SystemExit(main())
