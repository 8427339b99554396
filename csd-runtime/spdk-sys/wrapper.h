#include <spdk/stdinc.h>
#include <spdk/env.h>
#include <spdk/thread.h>
#include <spdk/init.h>
#include <spdk/rpc.h>
#include <spdk/log.h>
#include <spdk/bdev.h>
