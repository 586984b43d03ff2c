"""Base modules every layer may import (errors, atomic files); they import no other package of library/ nor
networks/."""
