from trainer.launch import main

raise SystemExit(main())
