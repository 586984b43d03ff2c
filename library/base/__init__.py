"""Base modules every layer may import (errors, atomic files, file-system checks, host-to-device moves); they import
nothing else of ours."""
