/* Times MPI_Allreduce, MPI_Allgather, MPI_Reduce_scatter_block and MPI_Alltoall exactly as
 * examples/bench_collectives.rs times candle-tp: iterations = clamp(budget / bytes, 5, 1000),
 * warm-up = max(2, iterations / 10), one barrier, every iteration timed on every rank, the
 * per-iteration maximum over ranks, then median / min / max on rank 0, one JSON line each.
 * Usage: mpirun -np N mpi_collectives [sizes...] (bytes; default 4K..64M in steps of 4x). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static long parse_size(const char *s) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*end == 'K' || *end == 'k') v <<= 10;
    else if (*end == 'M' || *end == 'm') v <<= 20;
    else if (*end == 'G' || *end == 'g') v <<= 30;
    return v;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    long defaults[] = {4L << 10, 16L << 10, 64L << 10, 256L << 10, 1L << 20, 4L << 20, 16L << 20, 64L << 20};
    int nsizes = argc > 2 ? argc - 2 : 8;
    const char *ops = argc > 1 ? argv[1] : "all_reduce,all_gather,reduce_scatter,all_to_all";
    long budget = 256L << 20;
    const char *names[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"};
    for (int o = 0; o < 4; o++) {
        if (!strstr(ops, names[o])) continue;
        for (int si = 0; si < nsizes; si++) {
            long bytes = argc > 2 ? parse_size(argv[2 + si]) : defaults[si];
            long n = bytes / 4;
            if (o > 0 && n % world != 0) continue;
            float *a = calloc(n, 4), *b = calloc(n, 4);
            long iters = budget / bytes;
            if (iters < 5) iters = 5;
            if (iters > 1000) iters = 1000;
            long warm = iters / 10 < 2 ? 2 : iters / 10;
            double *t = malloc(iters * sizeof(double)), *tmax = malloc(iters * sizeof(double));
            for (long i = 0; i < warm + iters; i++) {
                if (i == warm) MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                if (o == 0) MPI_Allreduce(MPI_IN_PLACE, a, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                else if (o == 1) MPI_Allgather(a, n / world, MPI_FLOAT, b, n / world, MPI_FLOAT, MPI_COMM_WORLD);
                else if (o == 2) MPI_Reduce_scatter_block(a, b, n / world, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                else MPI_Alltoall(a, n / world, MPI_FLOAT, b, n / world, MPI_FLOAT, MPI_COMM_WORLD);
                if (i >= warm) t[i - warm] = (MPI_Wtime() - t0) * 1e6;
            }
            MPI_Allreduce(t, tmax, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (rank == 0) {
                qsort(tmax, iters, sizeof(double), cmp);
                double med = tmax[iters / 2];
                double algbw = bytes / (med * 1e-6) / 1e9;
                double factor = (o == 0 ? 2.0 : 1.0) * (world - 1) / (double)world;
                printf("{\"impl\":\"mpi\",\"op\":\"%s\",\"dtype\":\"f32\",\"world_size\":%d,\"bytes\":%ld,"
                       "\"iters\":%ld,\"median_us\":%.3f,\"min_us\":%.3f,\"max_us\":%.3f,"
                       "\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f}\n",
                       names[o], world, bytes, iters, med, tmax[0], tmax[iters - 1], algbw, algbw * factor);
                fflush(stdout);
            }
            free(a); free(b); free(t); free(tmax);
        }
    }
    MPI_Finalize();
    return 0;
}
