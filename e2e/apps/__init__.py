"""Small apps the end-to-end tests serve (`e2e.apps.NAME:app`, from the repo root)."""
