"""python -m models.data prepare ... (see models/data/build.py)."""
from models.data.build import main

raise SystemExit(main())
