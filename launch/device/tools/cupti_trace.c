/* A CUPTI activity tracer loaded into a CUDA process by the driver (CUDA_INJECTION64_PATH):
 * every kernel, copy and memset on a GPU and every driver API call on the host, one line
 * each, "K|C|S|D <tab> start ns <tab> end ns <tab> name <tab> device" (the device is the
 * GPU's ordinal, -1 for a host call), into $CUPTI_TRACE_OUT at exit.
 * Built on the device by prefill-timeline.sh, which passes the header's newest record types
 * as KERNEL_T, MEMCPY_T and MEMSET_T. Read by timeline.py. */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;

static void report(CUptiResult r, const char *call) {
  if (r != CUPTI_SUCCESS) {
    const char *s = "?";
    cuptiGetResultString(r, &s);
    fprintf(stderr, "cupti_trace: %s: %s\n", call, s);
  }
}
#define CHECK(call) report((call), #call)

static void CUPTIAPI requested(uint8_t **buf, size_t *size, size_t *max_records) {
  *size = 32 << 20;
  *buf = (uint8_t *)aligned_alloc(8, *size);
  *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                               size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *rec = NULL;
  while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      KERNEL_T *k = (KERNEL_T *)rec;
      fprintf(out, "K\t%llu\t%llu\t%s\t%u\n", (unsigned long long)k->start,
              (unsigned long long)k->end, k->name, k->deviceId);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      MEMCPY_T *m = (MEMCPY_T *)rec;
      fprintf(out, "C\t%llu\t%llu\tmemcpy kind %d, %llu B\t%u\n", (unsigned long long)m->start,
              (unsigned long long)m->end, (int)m->copyKind, (unsigned long long)m->bytes, m->deviceId);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      MEMSET_T *m = (MEMSET_T *)rec;
      fprintf(out, "S\t%llu\t%llu\tmemset %llu B\t%u\n", (unsigned long long)m->start,
              (unsigned long long)m->end, (unsigned long long)m->bytes, m->deviceId);
      break;
    }
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)rec;
      const char *name = "?";
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
      fprintf(out, "D\t%llu\t%llu\t%s\t-1\n", (unsigned long long)a->start,
              (unsigned long long)a->end, name);
      break;
    }
    default:
      break;
    }
  }
  free(buf);
}

static void flush_at_exit(void) {
  CHECK(cuptiActivityFlushAll(1));
  fclose(out);
}

int InitializeInjection(void) {
  const char *path = getenv("CUPTI_TRACE_OUT");
  out = fopen(path ? path : "/tmp/cupti-trace.tsv", "w");
  if (!out) return 0;
  CHECK(cuptiActivityRegisterCallbacks(requested, completed));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER));
  atexit(flush_at_exit);
  return 1;
}
