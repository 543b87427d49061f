// st_reduce in each mode (store, residual add, SwiGLU pack, pack) and
// st_reduce_rms over random partials; writes every output to the file named
// last, for ab.sh to compare against another revision. Arguments: width,
// segments, rows.
#include <random>
int main(int argc, char** argv) {
    if (argc != 5) return 2;
    const int d = atoi(argv[1]), S = atoi(argv[2]), M = atoi(argv[3]);
    const int nt = (d + 15) / 16, ldp = nt * 16, mp = 16, akt = (d + 15) / 16, planes = 2;
    const hk_i64 part_seg = (hk_i64)mp * ldp, a_plane = (hk_i64)mp * akt * 16;
    std::mt19937 rng(11 + d + S);
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> part((size_t)S * part_seg), w(d);
    for (auto& x : part) x = U(rng);
    for (auto& x : w) x = 1 + 0.2f * U(rng);
    FILE* f = fopen(argv[4], "wb");
    for (int mode = 0; mode < 4; ++mode) {
        // mode 2 reads gate/up pairs: d / 2 channels in units of d / 4, padded to d / 4 + 3.
        const int ncols = mode == 2 ? d / 2 : d, uw = mode == 2 ? d / 4 : 1, uwp = mode == 2 ? d / 4 + 3 : 1;
        std::vector<float> out((size_t)mp * d, 0.5f);
        std::vector<unsigned short> ap((size_t)planes * a_plane * 2, 0);
        launch({(unsigned)((ncols + 1023) / 1024), (unsigned)M, 1}, 256, [&] {
            st_reduce(part.data(), part_seg, 0, ldp, M, ncols, S, 1, mode, out.data(), d, 0, ap.data(), a_plane * 2, akt * 2, uw, uwp);
        });
        fwrite(out.data(), 4, out.size(), f);
        fwrite(ap.data(), 2, ap.size(), f);
    }
    std::vector<float> h((size_t)mp * d);
    for (auto& x : h) x = 3 * U(rng);
    std::vector<unsigned short> a((size_t)planes * a_plane, 0);
    launch({(unsigned)M, 1, 1}, 256, [&] { st_reduce_rms(part.data(), part_seg, ldp, d, S, h.data(), w.data(), a.data(), a_plane, planes, d, akt, 1e-6f); });
    fwrite(h.data(), 4, h.size(), f);
    fwrite(a.data(), 2, a.size(), f);
    fclose(f);
    return 0;
}
