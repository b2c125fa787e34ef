#include "tests/core/harness.h"
