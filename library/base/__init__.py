"""Base modules every layer may import (errors, atomic files); they import nothing else of ours."""
