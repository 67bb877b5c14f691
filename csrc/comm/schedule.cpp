#include "comm/schedule.h"
